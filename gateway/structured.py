"""A request's output constraint: the request fields that ask for one, each checked here
(400 with the reason) so that a worker only ever receives constraints that compile, and turned
into one ``StructuredSpec``.

``response_format``: ``text`` (none), ``json_object`` (any JSON object), ``json_schema``
(``schema``, with or without ``strict``: the output follows the schema either way).
``structured_outputs`` / ``guided_*`` (vLLM's newer and older spellings): ``json`` (a schema),
``regex``, ``choice``, ``grammar`` (Lark, or GBNF/EBNF as llama.cpp and xgrammar write it),
``json_object``. ``tool_choice`` ``required`` or a named function, as vLLM builds them
(``tool_choice_constraint``)::

    named       the function's parameters schema: the output is its arguments object
                (no parameters: any JSON object)
    required    [{"name": <one of the tools>, "parameters": <that tool's schema>}, ...]
                an array of at least one call (at most one without parallel_tool_calls)

A tool's schema sits inside the array's schema, so its local ``$ref`` pointers ("#/$defs/X")
are rewritten to point into its own place ("#/items/anyOf/0/properties/parameters/$defs/X");
vLLM hoists ``$defs`` instead, and refuses two tools that define one name differently.
At most one constraint a request.
"""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.grammar import grammar_text
from pdserve.gateway.errors import invalid_request
from pdserve.gateway.tools.models import NamedToolChoice, Tool, ToolFields
from pdserve.gateway.tools.request import ToolRequest, unknown_function
from pdserve.protocol.messages import StructuredSpec

ANY_OBJECT = '{"type": "object"}'
ANY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a tool without a schema
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: left as given
# name -> schema maps: a property named "default" is a schema all the same
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

# a schema, regex or grammar larger than this is refused before it is parsed (engine.grammar
# checks it again in characters)
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256

Choice = Annotated[str, Field(min_length=1, max_length=1024)]
Text = Annotated[str, Field(max_length=MAX_SPEC_CHARS)]


class _Strict(BaseModel):
    # a misspelled constraint field must not pass as "no constraint"
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(max_length=256)] = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | bool | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Choice], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None  # always so here (compact JSON)
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: None = None  # not supported: only null accepted


class StructuredFields(BaseModel):
    """The constraint fields, mixed into both request bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spellings of structured_outputs
    guided_json: dict[str, Any] | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Choice], Field(min_length=1, max_length=MAX_CHOICES)] | None = (
        None
    )
    guided_grammar: Text | None = None
    guided_decoding_backend: str | None = None  # accepted; the backend is llguidance
    guided_whitespace_pattern: None = None  # not supported: only null accepted


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


def tool_choice_constraint(req: ToolRequest) -> StructuredSpec | None:
    """The ``StructuredSpec`` that ``req``'s tool_choice asks for, or None ("none", "auto",
    no tools). 400 when a named function is not among the tools."""
    choice = req.tool_choice
    if not req.tools or choice is None or choice in ("none", "auto"):
        return None
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in req.tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise unknown_function(choice.function.name)
        return StructuredSpec("json", json.dumps(tool.function.parameters or ANY_PARAMETERS))
    schema = required_schema(req.tools, parallel=req.parallel_tool_calls is not False)
    return StructuredSpec("json", json.dumps(schema))


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"`` (with ``additionalProperties: false``
    on each call, so a call is exactly its name and parameters)."""
    calls = []
    for i, tool in enumerate(tools):
        where = f"#/items/anyOf/{i}/properties/parameters"
        parameters = tool.function.parameters or ANY_PARAMETERS
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": _rebase_refs(parameters, where),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebase_refs(schema: Any, where: str) -> Any:
    """A copy of ``schema`` whose local ``$ref``s ("#...") point below ``where``."""
    if isinstance(schema, list):
        return [_rebase_refs(item, where) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}  # a JSON Schema: any JSON value under each keyword
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = where + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, where) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, where)
    return out
