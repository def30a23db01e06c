"""A request's output constraint: ``response_format``, ``structured_outputs`` or ``guided_*``
as one ``StructuredSpec``, checked here (400 with the reason) so that a worker only ever
receives constraints that compile.

``response_format``: ``text`` (none), ``json_object`` (any JSON object), ``json_schema``
(``schema``, with or without ``strict``: the output follows the schema either way).
``structured_outputs`` / ``guided_*``: ``json`` (a schema), ``regex``, ``choice``, ``grammar``
(Lark, or GBNF/EBNF as llama.cpp and xgrammar write it), ``json_object``. ``tool_choice``
``required`` or a named function: JSON for the tools' schemas (``gateway.tools.constraint``).
At most one constraint a request.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pdserve.engine.grammar import grammar_text
from pdserve.gateway.errors import invalid_request
from pdserve.gateway.structured_models import StructuredFields
from pdserve.gateway.tools.constraint import tool_choice_constraint
from pdserve.gateway.tools.models import ToolFields
from pdserve.protocol.messages import StructuredSpec

ANY_OBJECT = '{"type": "object"}'


def structured_spec(req: StructuredFields) -> StructuredSpec | None:
    """The constraint ``req`` asks for (validated), or None; ``OpenAIError`` (400) when it is
    malformed, does not compile, or more than one is given."""
    found = [(param, spec) for param, spec in _candidates(req) if spec is not None]
    if len(found) > 1:
        names = ", ".join(param for param, _ in found)
        raise invalid_request(f"give at most one output constraint, got {names}", found[1][0])
    if not found:
        return None
    param, spec = found[0]
    check_spec(spec, param)
    return spec


def check_spec(spec: StructuredSpec, param: str) -> None:
    """400 naming ``param`` when ``spec`` does not compile."""
    error = _compile_error(spec)
    if error is not None:
        raise invalid_request(error, param)


@functools.lru_cache(maxsize=256)
def _compile_error(spec: StructuredSpec) -> str | None:
    """A repeated schema (every call of an agent loop) is checked once."""
    try:
        grammar_text(spec)
    except ValueError as e:
        return str(e)
    return None


def _candidates(req: StructuredFields) -> list[tuple[str, StructuredSpec | None]]:
    out: list[tuple[str, StructuredSpec | None]] = []
    if req.response_format is not None:
        out.append(("response_format", _from_response_format(req)))
    if req.structured_outputs is not None:
        out.append(("structured_outputs", _from_structured_outputs(req)))
    guided = [
        ("guided_json", "json", req.guided_json),
        ("guided_regex", "regex", req.guided_regex),
        ("guided_choice", "choice", req.guided_choice),
        ("guided_grammar", "grammar", req.guided_grammar),
    ]
    out += [(param, _spec(kind, value)) for param, kind, value in guided if value is not None]
    if isinstance(req, ToolFields):  # a named or required tool call: JSON for its schema
        out.append(("tool_choice", tool_choice_constraint(req)))
    return out


def _from_response_format(req: StructuredFields) -> StructuredSpec | None:
    rf = req.response_format
    assert rf is not None
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredSpec("json", ANY_OBJECT)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise invalid_request(
            "response_format json_schema needs json_schema.schema", "response_format"
        )
    return _spec("json", rf.json_schema.schema_)


def _from_structured_outputs(req: StructuredFields) -> StructuredSpec | None:
    so = req.structured_outputs
    assert so is not None
    given = [
        (kind, value)
        for kind, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
        )
        if value is not None
    ]
    if so.json_object:
        given.append(("json", ANY_OBJECT))
    if len(given) != 1:
        raise invalid_request(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    return _spec(*given[0])


def _spec(kind: str, value: Any) -> StructuredSpec:
    if kind == "choice" or (kind == "json" and not isinstance(value, str)):
        value = json.dumps(value)
    return StructuredSpec(kind, value)  # type: ignore[arg-type]
