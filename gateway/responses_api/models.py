"""The request body of ``POST /v1/responses`` (OpenAI's shapes), validated by FastAPI.

Unlike the chat body, an unknown top-level field is a 400 naming it (as OpenAI answers it):
the Responses API has many fields that would change the output, and a new one must not pass
as honoured. Fields are declared in three groups:

    honoured     model input instructions max_output_tokens temperature top_p tools
                 tool_choice parallel_tool_calls text.format stream metadata (echoed)
                 vLLM's seed top_k min_p repetition_penalty priority
    ignored      user safety_identifier prompt_cache_key prompt_cache_retention service_tier
                 stream_options (no obfuscation) max_tool_calls (bounds built-in tools: none)
    refused      store: true, previous_response_id, conversation, background: true, prompt,
    when set     reasoning (effort, summary), include, top_logprobs > 0, truncation: "auto",
                 text.verbosity (``translate.check_supported`` says why)

Items, tools and tool choices are parsed loosely (``type`` any string) so that
``translate`` refuses a built-in tool or an image part with a message naming its place
(``tools[1].type``), not pydantic's list of union branches.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.config import JsonDict

from pdserve.gateway.openai_models import INT64_MAX, INT64_MIN
from pdserve.gateway.tools.models import MAX_TOOLS, FunctionName
from pdserve.protocol.sampling import MAX_LOGPROBS
from pdserve.protocol.tenancy import MAX_PRIORITY, MIN_PRIORITY

MAX_ITEMS = 4096  # input items of one request
# OpenAPI: the values the server takes, so schema-driven clients and fuzzers send them
_UNSET: JsonDict = {"enum": [None]}
_EMPTY: JsonDict = {"maxItems": 0}


def _only(*values: Any) -> JsonDict:
    return {"enum": list(values)}


MAX_METADATA = 16  # OpenAI's: 16 pairs, keys up to 64 characters, values up to 512


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ContentPart(_Body):
    """A message's part: ``input_text``, ``output_text`` (``text``) or ``refusal`` (an
    assistant's, ``refusal``); others (images, files, audio) are refused."""

    type: str = Field(json_schema_extra=_only("input_text", "output_text", "refusal"))
    text: str | None = None
    refusal: str | None = None


def _as_parts(value: Any) -> Any:
    """A plain string is one text part."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


Content = Annotated[
    list[ContentPart],
    BeforeValidator(_as_parts, json_schema_input_type=str | list[ContentPart]),
]


class InputItem(_Body):
    """One ``input`` item; the fields it needs depend on ``type``: ``message`` (the default:
    ``role``, ``content``), ``function_call`` (``call_id``, ``name``, ``arguments``: a call
    the model made, fed back), ``function_call_output`` (``call_id``, ``output``). ``id`` and
    ``status`` of items fed back from a response are accepted and ignored."""

    type: str = Field(
        default="message",
        json_schema_extra=_only("message", "function_call", "function_call_output"),
    )
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Content | None = None
    call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    name: FunctionName | None = None
    arguments: str | None = None
    output: Content | None = None


def _as_items(value: Any) -> Any:
    """A plain string is one user message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}] if value else []
    return value


Input = Annotated[
    list[InputItem],
    Field(max_length=MAX_ITEMS),
    BeforeValidator(_as_items, json_schema_input_type=str | list[InputItem]),
]


class FunctionTool(_Body):
    """``{"type": "function", "name", "description", "parameters", "strict"}`` (the
    Responses API's flat shape); another ``type`` (a built-in tool) is refused."""

    type: str = Field(json_schema_extra=_only("function"))
    name: FunctionName | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(_Body):
    """``{"type": "function", "name": ...}``; other types (built-in, MCP, allowed_tools) are
    refused."""

    type: str = Field(json_schema_extra=_only("function"))
    name: FunctionName | None = None


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceObject


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=256)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, json_schema_extra=_UNSET)


class Reasoning(_Body):
    effort: str | None = Field(None, json_schema_extra=_UNSET)  # no reasoning model here
    summary: str | None = Field(None, json_schema_extra=_UNSET)
    generate_summary: str | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None  # None: the only model served
    input: Input
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = (
        None
    )
    stream: bool | None = False
    # accepted and ignored
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    # refused when set (translate.check_supported)
    store: bool | None = Field(None, json_schema_extra=_only(False, None))
    previous_response_id: str | None = Field(None, json_schema_extra=_UNSET)
    conversation: str | dict[str, Any] | None = Field(None, json_schema_extra=_UNSET)
    background: bool | None = Field(None, json_schema_extra=_only(False, None))
    prompt: dict[str, Any] | None = Field(None, json_schema_extra=_UNSET)
    reasoning: Reasoning | None = None
    include: list[str] | None = Field(None, json_schema_extra=_EMPTY)
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, json_schema_extra=_only(0, None)
    )
    truncation: Literal["auto", "disabled"] | None = Field(
        None, json_schema_extra=_only("disabled", None)
    )
    # vLLM's extras
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    priority: int | None = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
