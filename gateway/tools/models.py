"""Request fields of tool calling, OpenAI's shapes: ``tools``, ``tool_choice``, and the
``tool_calls`` an assistant message carries.

Bounds: at most ``MAX_TOOLS`` tools and ``MAX_TOOL_CALLS`` calls a message; a function name is
1 to 64 letters, digits, ``_ - . :`` (OpenAI's rule, plus the dots and colons MCP tool names
use: the name is written into prompts and parsed back out of JSON); a function's parameters
schema at most ``MAX_SCHEMA_CHARS`` characters of JSON (``gateway.tools.request`` checks it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
MAX_SCHEMA_CHARS = 64 * 1024  # what a constraint may hold (engine.grammar.MAX_SPEC_CHARS)
NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,64}$"

FunctionName = Annotated[str, Field(pattern=NAME_PATTERN)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class FunctionDefinition(_Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema for the arguments object
    strict: bool | None = None  # the arguments follow the schema whenever a call is constrained


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    """``{"type": "function", "function": {"name": ...}}``: call that function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Body):
    name: str
    # OpenAI sends a JSON string; a JSON object is taken too, as vLLM does
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolFields(_Body):
    """Mixed into the chat request body."""

    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


ToolCalls = Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)]
