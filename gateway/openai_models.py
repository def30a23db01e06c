"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI plus vLLM extras),
and their conversion to ``SamplingParams``.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do. Known fields that would
change the output in a way this server cannot honour (logit_bias, echo...) are refused
with a 400 rather than silently ignored; ``gateway.request_audit`` lists vLLM's.

Limits: ``n`` <= 16; 256 prompts a request; ``logprobs`` / ``top_logprobs`` <= 20; 4 stop
strings of at most 256 characters (the stop matcher's work per token grows with their length);
integers the wire can carry (64-bit); finite numbers; sampling ranges as ``SamplingParams``
checks them. ``max_tokens`` is bounded by the model's context in ``jobs``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from pdserve.gateway.errors import OpenAIError, invalid_request
from pdserve.gateway.request_audit import VllmChatFields, VllmFields, refuse_unhonoured
from pdserve.gateway.structured import structured_spec
from pdserve.gateway.structured_models import StructuredFields
from pdserve.gateway.tools.models import ToolCalls, ToolFields
from pdserve.gateway.tools.request import check_tools, template_tool_calls
from pdserve.protocol.sampling import MAX_LOGPROBS, SamplingParams

MAX_N = 16
MAX_PROMPTS = 256  # prompts of one /v1/completions request: each is a backend request
MAX_STOP = 4
MAX_STOP_CHARS = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-200 answer of the API."""

    error: ErrorDetail


_ERROR_STATUSES = {
    400: "Invalid request (including a prompt or max_tokens beyond the model's context)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body too large",
    415: "Content type is not application/json",
    429: "Overloaded; see Retry-After",
    500: "Internal error",
    503: "Unavailable or draining; see Retry-After",
    504: "The request timed out (--request-timeout) and was aborted",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in _ERROR_STATUSES.items()
}


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]  # developer: as system
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: ToolCalls | None = None  # an assistant's calls; content may then be null

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far on every chunk too


# Ranges as ``SamplingParams`` checks them, so the OpenAPI schema states them too.
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Unsupported = {"maxItems": 0, "maxProperties": 0, "maxLength": 0}  # schema: only empty values


def _stop_limits(value: Any) -> Any:
    """One clear message for every bad ``stop`` (pydantic's names a union branch)."""
    stops = [value] if isinstance(value, str) else value
    if value is None or (
        isinstance(stops, list)
        and all(isinstance(s, str) for s in stops)
        and len(stops) <= MAX_STOP
        and all(len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        return value
    raise PydanticCustomError(
        "stop_limit",
        f"must be a string or a list of at most {MAX_STOP} strings, each at most "
        f"{MAX_STOP_CHARS} characters long",
    )


class _SamplingFields(VllmFields, StructuredFields):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=Unsupported)
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    _check_stop = field_validator("stop", mode="before")(_stop_limits)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM: usage on every chunk, only together with include_usage."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class ChatCompletionRequest(_SamplingFields, VllmChatFields, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM: the bos etc. on top of what the template writes
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            role = "system" if m.role == "developer" else m.role  # as OpenAI and vLLM do
            message: dict[str, Any] = {"role": role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                where = f"messages[{i}].tool_calls"
                message["tool_calls"] = template_tool_calls(m.tool_calls, where)
            out.append(message)
        return out


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = Field(None, json_schema_extra=Unsupported)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs


AnyRequest = ChatCompletionRequest | CompletionRequest


def check_supported(req: AnyRequest) -> None:
    """Refuse what parses but cannot be honoured; raises ``OpenAIError`` (400)."""
    refuse_unhonoured(req, req.n)
    if req.stream_options is not None and not req.stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", "stream_options"
        )
    if req.logit_bias:
        raise invalid_request("logit_bias is not supported", "logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        check_tools(req)
    else:
        if req.echo:
            raise invalid_request("echo is not supported", "echo")
        if req.suffix:
            raise invalid_request("suffix is not supported", "suffix")


def sampling_params(req: AnyRequest, max_tokens: int) -> SamplingParams:
    """The ``SamplingParams`` of ``req``: a field the request leaves unset keeps the type's
    default (the one a worker would use); a value out of range is a 400 naming its field."""
    d = _DEFAULTS
    structured = structured_spec(req)  # its own errors name their field
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_given(req.temperature, d.temperature),
            top_p=_given(req.top_p, d.top_p),
            top_k=_given(req.top_k, d.top_k),
            min_p=_given(req.min_p, d.min_p),
            presence_penalty=_given(req.presence_penalty, d.presence_penalty),
            frequency_penalty=_given(req.frequency_penalty, d.frequency_penalty),
            repetition_penalty=_given(req.repetition_penalty, d.repetition_penalty),
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            min_tokens=_given(req.min_tokens, d.min_tokens),
            logprobs=req.requested_logprobs(),
            structured=structured,
        )
    except ValueError as e:
        raise _sampling_error(str(e), req) from e


_DEFAULTS = SamplingParams()
T = TypeVar("T")


def _given(value: T | None, default: T) -> T:
    return default if value is None else value


def _sampling_error(message: str, req: AnyRequest) -> OpenAIError:
    param = message.split(" ", 1)[0].strip("()")
    if param == "max_tokens" and isinstance(req, ChatCompletionRequest):
        param = "max_completion_tokens" if req.max_completion_tokens is not None else param
    if param == "logprobs" and isinstance(req, ChatCompletionRequest):
        param = "top_logprobs"
    known = param in SamplingParams.__dataclass_fields__ or param in type(req).model_fields
    return invalid_request(message, param if known else None)
