"""A prompt's size checked before it is tokenized whole: bounded work and memory per request.

Tokenizing a text costs memory per token (an 8 MiB prompt took the gateway from 66 to 931 MiB),
so a text too long to be short is counted in pieces of ``CHUNK_CHARS`` characters, and refused
(400 ``context_length_exceeded``) as soon as the count passes the context length: at most
about ``max_model_len`` tokens and one piece are ever tokenized for it, whatever its size. A
cut between pieces can split a word into more tokens than it has whole, so each cut allows
``SLACK_PER_CUT`` tokens before the text is refused; a text that passes is then tokenized
whole and checked exactly as before.
"""

from __future__ import annotations

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import OpenAIError

CHARS_PER_TOKEN = 4  # up to max_model_len * this many characters, tokenize whole at once
CHUNK_CHARS = 16384
WHOLE_CHARS = 4 * CHUNK_CHARS  # and up to this many, whatever the context length
SLACK_PER_CUT = 2
_CUT_WINDOW = 256  # cut at the last whitespace this close to a piece's end


def check_prompt_size(text: str, tokenizer: Tokenizer, max_model_len: int, param: str) -> None:
    """Raise a 400 if ``text`` surely holds more tokens than ``max_model_len``."""
    if max_model_len <= 0 or len(text) <= max(max_model_len * CHARS_PER_TOKEN, WHOLE_CHARS):
        return
    count = cuts = start = 0
    while start < len(text):
        end = _cut(text, start + CHUNK_CHARS)
        count += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        cuts += end < len(text)
        if count > max_model_len + SLACK_PER_CUT * cuts:
            raise too_long(max_model_len, param)
        start = end


def too_long(max_model_len: int, param: str) -> OpenAIError:
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested more than {max_model_len} tokens in the {param}. Please reduce the length "
        f"of the {param}."
    )
    return OpenAIError(400, message, param=param, code="context_length_exceeded")


def _cut(text: str, end: int) -> int:
    """``end``, moved back to just after a whitespace close before it if there is one."""
    if end >= len(text):
        return len(text)
    for i in range(end - 1, max(end - _CUT_WINDOW, 0), -1):
        if text[i].isspace():
            return i + 1
    return end
