"""``--chat-template``: one Jinja template that replaces every served model's own, vLLM's way.

The value is a file to read or, when no such file exists and it looks like Jinja (braces or a
newline), the template itself. It is parsed at start-up, so a broken one stops the gateway
with a message instead of failing every chat request.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jinja2
import tokenizers

from pdserve.engine.tokenizer import Tokenizer

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template ``value`` names; ``ValueError`` with a message for the user."""
    try:
        text = Path(value).read_text(encoding="utf-8")
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"cannot read the chat template file {value}: {e.strerror}") from e
        text = value
    except UnicodeDecodeError as e:
        raise ValueError(f"the chat template file {value} is not UTF-8 text: {e}") from e
    check_chat_template(text)
    return text


def check_chat_template(text: str) -> None:
    """Raise ``ValueError`` if ``text`` is not a Jinja template the engine's renderer takes."""
    if not text.strip():
        raise ValueError("the chat template is empty")
    vocab = tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")
    probe = Tokenizer(tokenizers.Tokenizer(vocab)).with_chat_template(text)
    try:
        probe.apply_chat_template([{"role": "user", "content": "hi"}])
    except ValueError as e:
        # Only a syntax error is the template's fault whatever the chat: a template may
        # raise_exception() on this one (no system message...) and be right to.
        if isinstance(e.__cause__, jinja2.TemplateSyntaxError):
            raise ValueError(f"the chat template is not valid Jinja: {e.__cause__}") from e


def tokenizer_loader(template: str | None) -> Callable[[str], Tokenizer]:
    """Load a model directory's tokenizer, with ``template`` in place of its own if given."""
    if template is None:
        return Tokenizer.from_dir
    return lambda root: Tokenizer.from_dir(root).with_chat_template(template)
