"""Request bodies of ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI plus vLLM extras),
and what they may not ask for (``check_supported``); ``gateway.jobs`` turns them into a ``Job``.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do. Known fields that would
change the output in a way this server cannot honour (logit_bias, suffix...) are refused
with a 400 rather than silently ignored.

Limits: ``n`` <= 16; 256 prompts a request; ``logprobs`` / ``top_logprobs`` <= 20; 4 stop
strings of at most 256 characters (the stop matcher's work per token grows with their length);
integers the wire can carry (64-bit); finite numbers; sampling ranges as ``SamplingParams``
checks them. ``max_tokens`` is bounded by the model's context in ``jobs``.

The vLLM fields this server does not honour are declared (``VllmFields``, ``VllmChatFields``),
so that a request which sets one is refused with a 400 instead of a 200 that did something
else. Audit of the fields vLLM accepts beyond the OpenAI ones (structured outputs and tools:
``gateway.structured``, ``gateway.tools``):

refused (400) when set to anything but their default:
    best_of (unless 1 or equal to n)  use_beam_search  include_stop_str_in_output
    truncate_prompt_tokens  allowed_token_ids  bad_words  logprob_token_ids
    logits_processors  cache_salt (no per-tenant prefix cache)  kv_transfer_params (vLLM's
    connector API)  vllm_xargs  return_tokens_as_token_ids  return_token_ids  prompt_embeds;
honoured: priority (vLLM's: lower first, within the key's tenant and tier).
    chat only: echo  continue_final_message  chat_template (per request: a server chooses its
    template with --chat-template, as vLLM without --trust-request-chat-template)  documents
    (refused in ``check_supported`` as well: logit_bias; completions' suffix; echo and
    prompt_logprobs with n > 1)
honoured: prompt_logprobs (vLLM's), completions' echo (with max_tokens 0: the prompt scored,
    nothing generated), add_special_tokens, skip_special_tokens, min_tokens,
    stop_token_ids, ignore_eos, top_k, min_p, repetition_penalty, stream_options.
accepted and ignored, since they cannot change the output here:
    user  store  metadata  service_tier  session_id  request_id (the response id is always
    the gateway's own, unique in the cluster)  length_penalty and truncation_side (only
    meaningful with beam search / truncation, both refused)  spaces_between_special_tokens
    (fast tokenizers ignore it, in vLLM too)  guided_decoding_backend (the grammar engine is the
    server's choice; the output obeys the grammar either way)  stream_interval (chunking only)
    mm_processor_kwargs and media_io_kwargs (text-only server)  include_reasoning,
    reasoning_effort, thinking_token_budget (no reasoning parser: output is plain content).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError

from pdserve.gateway.errors import invalid_request
from pdserve.gateway.structured import StructuredFields
from pdserve.gateway.tools.models import ToolCalls, ToolFields
from pdserve.gateway.tools.request import check_tools, template_tool_calls
from pdserve.protocol.sampling import MAX_LOGPROBS
from pdserve.protocol.tenancy import MAX_PRIORITY, MIN_PRIORITY

MAX_N = 16
MAX_PROMPTS = 256  # prompts of one /v1/completions request: each is a backend request
MAX_STOP = 4
MAX_STOP_CHARS = 256
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


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
Unsupported: JsonDict = {"maxItems": 0, "maxProperties": 0, "maxLength": 0}  # schema: empty only


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


# OpenAPI: the only value the server takes, so schema-driven clients and fuzzers send it.
_OFF: JsonDict = {"enum": [False]}
_UNSET: JsonDict = {"enum": [None]}
_EMPTY: JsonDict = {"maxItems": 0}

_REASONS = {
    "use_beam_search": "beam search is not supported",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported: a matched stop "
    "string is never part of the output",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported: a prompt beyond the "
    "context is refused instead",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "logprob_token_ids": "logprob_token_ids is not supported",
    "logits_processors": "logits_processors is not supported",
    "cache_salt": "cache_salt is not supported: the prefix cache is shared by every request",
    "kv_transfer_params": "kv_transfer_params is not supported: this server moves KV itself",
    "vllm_xargs": "vllm_xargs is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "return_token_ids": "return_token_ids is not supported",
    "prompt_embeds": "prompt_embeds is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "chat_template": "a chat template per request is not supported: the server's template "
    "(--chat-template) applies",
    "documents": "documents are not supported",
}


class VllmFields(_Body):
    """vLLM extras of both generation endpoints that are refused when set."""

    # schema: 1 (or left out), which any n takes; the server takes best_of == n too
    best_of: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra={"enum": [1, None]},
        description="accepted when equal to n",
    )
    # each prompt token's logprob (from the second), with this many alternatives (vLLM's)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    use_beam_search: bool | None = Field(default=False, json_schema_extra=_OFF)
    include_stop_str_in_output: bool | None = Field(default=False, json_schema_extra=_OFF)
    truncate_prompt_tokens: int | None = Field(default=None, json_schema_extra=_UNSET)
    allowed_token_ids: list[int] | None = Field(default=None, json_schema_extra=_EMPTY)
    bad_words: list[str] | None = Field(default=None, json_schema_extra=_EMPTY)
    logprob_token_ids: list[int] | None = Field(default=None, json_schema_extra=_EMPTY)
    logits_processors: list[Any] | None = Field(default=None, json_schema_extra=_EMPTY)
    # vLLM's: lower is served sooner, within the tenant's tier (pdserve.fair_queue)
    priority: int | None = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    cache_salt: str | None = Field(default=None, json_schema_extra=_UNSET)
    kv_transfer_params: dict[str, Any] | None = Field(default=None, json_schema_extra=_UNSET)
    vllm_xargs: dict[str, Any] | None = Field(default=None, json_schema_extra=_UNSET)
    return_tokens_as_token_ids: bool | None = Field(default=False, json_schema_extra=_OFF)
    return_token_ids: bool | None = Field(default=False, json_schema_extra=_OFF)
    prompt_embeds: str | list[str] | None = Field(default=None, json_schema_extra=_UNSET)


class VllmChatFields(_Body):
    """Chat-only extras that are refused when set."""

    echo: bool | None = Field(default=False, json_schema_extra=_OFF)
    continue_final_message: bool | None = Field(default=False, json_schema_extra=_OFF)
    chat_template: str | None = Field(default=None, json_schema_extra=_UNSET)
    documents: list[dict[str, Any]] | None = Field(default=None, json_schema_extra=_EMPTY)


class _SamplingFields(VllmFields, StructuredFields):
    model: str
    # 0: only with the prompt scored (echo, prompt_logprobs): ``SamplingParams`` checks it
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra=Unsupported)
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
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
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

    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

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
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True
    suffix: str | None = Field(default=None, json_schema_extra=Unsupported)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """Alternatives to compute for each prompt token: ``prompt_logprobs``, or with ``echo``
        the ``logprobs`` asked for (the prompt's tokens are listed before the output's); an
        echo of ``max_tokens`` 0 scores the prompt whatever (nothing else runs)."""
        asked = [self.prompt_logprobs]
        if self.echo:
            asked += [self.logprobs, 0 if self.max_tokens == 0 else None]
        given = [k for k in asked if k is not None]
        return max(given) if given else None


AnyRequest = ChatCompletionRequest | CompletionRequest


def _is_set(value: Any, default: Any) -> bool:
    """Not the default nor an empty value (by identity: ``prompt_logprobs: 0`` is set)."""
    if value is None or value is False or value == default:
        return False
    return not (isinstance(value, list | dict) and not value)


def refuse_unhonoured(req: BaseModel, n: int) -> None:
    """Raise a 400 ``OpenAIError`` naming the first field ``req`` sets that this server would
    ignore; ``n`` is the request's choice count (``best_of`` may be 1 or repeat it)."""
    best_of = getattr(req, "best_of", None)
    if best_of not in (None, 1, n):
        message = (
            f"best_of must be 1 or equal n ({n}) when given, got {best_of}: every sampled "
            "choice is returned, none is dropped"
        )
        raise invalid_request(message, "best_of")
    fields = type(req).model_fields
    for name, reason in _REASONS.items():
        if name in fields and _is_set(getattr(req, name), fields[name].default):
            raise invalid_request(reason, name)


def check_supported(req: AnyRequest) -> None:
    """Refuse what parses but cannot be honoured; raises ``OpenAIError`` (400)."""
    refuse_unhonoured(req, req.n)
    if req.prompt_logprobs is not None and req.n > 1:
        raise invalid_request("prompt_logprobs is for one choice a prompt (n=1)", "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise invalid_request(
            "stream_options is only allowed when stream is true", "stream_options"
        )
    if req.logit_bias:
        raise invalid_request("logit_bias is not supported", "logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and req.top_logprobs > 0 and not req.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.echo:
            message = "echo is not supported on chat: the messages are the client's own"
            raise invalid_request(message, "echo")
        check_tools(req)
    else:
        if req.echo and req.n > 1:
            raise invalid_request("echo is for one choice a prompt (n=1)", "echo")
        if req.suffix:
            raise invalid_request("suffix is not supported", "suffix")
