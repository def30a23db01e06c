"""The output constraint of a ``required`` or named ``tool_choice``, as vLLM builds it.

    named       the function's parameters schema: the output is its arguments object
                (no parameters: any JSON object)
    required    [{"name": <one of the tools>, "parameters": <that tool's schema>}, ...]
                an array of at least one call (at most one without parallel_tool_calls)

A tool's schema sits inside the array's schema, so its local ``$ref`` pointers ("#/$defs/X")
are rewritten to point into its own place ("#/items/anyOf/0/properties/parameters/$defs/X");
vLLM hoists ``$defs`` instead, and refuses two tools that define one name differently.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.gateway.tools.models import NamedToolChoice, Tool
from pdserve.gateway.tools.request import ToolRequest, unknown_function
from pdserve.protocol.messages import StructuredSpec

ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: left as given
# name -> schema maps: a property named "default" is a schema all the same
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


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
        return StructuredSpec("json", json.dumps(tool.function.parameters or ANY_OBJECT))
    schema = required_schema(req.tools, parallel=req.parallel_tool_calls is not False)
    return StructuredSpec("json", json.dumps(schema))


def required_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for ``tool_choice: "required"`` (with ``additionalProperties: false``
    on each call, so a call is exactly its name and parameters)."""
    calls = []
    for i, tool in enumerate(tools):
        where = f"#/items/anyOf/{i}/properties/parameters"
        parameters = tool.function.parameters or ANY_OBJECT
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
    out = {}
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
