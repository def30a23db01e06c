"""Chat templates as transformers renders them: the files they come from, a sandboxed Jinja
environment with HF's extras (``tojson`` without HTML escapes, ``raise_exception``,
``strftime_now``, the ``{% generation %}`` tag, loop controls), compiled templates cached."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox


def read_chat_templates(path: Path, value: str | list[dict[str, str]] | None) -> dict[str, str]:
    """Named templates; ``chat_template.jinja`` files take priority over tokenizer_config.json."""
    templates: dict[str, str] = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    for file in sorted((path / "additional_chat_templates").glob("*.jinja")):
        templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    if isinstance(value, str):
        return {"default": value}
    return {t["name"]: t["template"] for t in value or []}


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker) renders its body."""

    # jinja annotates ``tags`` as a set but only reads it; frozen, the class attribute stays fixed
    tags = frozenset({"generation"})  # type: ignore[assignment]

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from its caller (``messages``, ``tools``...);
    ``ValueError`` when it does not parse."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    return _environment().from_string(template)
