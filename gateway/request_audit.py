"""vLLM request fields this server does not honour: declared, so that a request which sets one is
refused with a 400 instead of getting a 200 that did something else.

Audit of the fields vLLM's ``/v1/chat/completions`` and ``/v1/completions`` accept beyond
those ``gateway.openai_models`` honours (structured outputs and tool fields are honoured
elsewhere and are not listed here):

refused (400) when set to anything but their default:
    best_of (unless 1 or equal to n)  prompt_logprobs  use_beam_search  include_stop_str_in_output
    truncate_prompt_tokens  allowed_token_ids  bad_words  logprob_token_ids
    logits_processors  priority (no priority scheduling)  cache_salt (no per-tenant prefix
    cache)  kv_transfer_params (vLLM's connector API)  vllm_xargs  return_tokens_as_token_ids
    return_token_ids  prompt_embeds;
    chat only: echo  continue_final_message  chat_template (per request: a server chooses its
    template with --chat-template, as vLLM without --trust-request-chat-template)  documents
    (already refused in openai_models: logit_bias; completions' echo and suffix)
honoured (openai_models): add_special_tokens, skip_special_tokens, min_tokens,
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

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pdserve.gateway.errors import invalid_request

# OpenAPI: the only value the server takes, so schema-driven clients and fuzzers send it.
_OFF = {"enum": [False]}
_UNSET = {"enum": [None]}
_EMPTY = {"maxItems": 0}

_REASONS = {
    "prompt_logprobs": "prompt_logprobs is not supported",
    "use_beam_search": "beam search is not supported",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported: a matched stop "
    "string is never part of the output",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported: a prompt beyond the "
    "context is refused instead",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "bad_words": "bad_words is not supported",
    "logprob_token_ids": "logprob_token_ids is not supported",
    "logits_processors": "logits_processors is not supported",
    "priority": "priority scheduling is not supported: priority must be 0",
    "cache_salt": "cache_salt is not supported: the prefix cache is shared by every request",
    "kv_transfer_params": "kv_transfer_params is not supported: this server moves KV itself",
    "vllm_xargs": "vllm_xargs is not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "return_token_ids": "return_token_ids is not supported",
    "prompt_embeds": "prompt_embeds is not supported",
    "echo": "echo is not supported",
    "continue_final_message": "continue_final_message is not supported",
    "chat_template": "a chat template per request is not supported: the server's template "
    "(--chat-template) applies",
    "documents": "documents are not supported",
}


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class VllmFields(_Fields):
    """vLLM extras of both generation endpoints that are refused when set."""

    # schema: 1 (or left out), which any n takes; the server takes best_of == n too
    best_of: int | None = Field(
        None, ge=1, json_schema_extra={"enum": [1, None]}, description="accepted when equal to n"
    )
    prompt_logprobs: int | None = Field(None, json_schema_extra=_UNSET)
    use_beam_search: bool | None = Field(False, json_schema_extra=_OFF)
    include_stop_str_in_output: bool | None = Field(False, json_schema_extra=_OFF)
    truncate_prompt_tokens: int | None = Field(None, json_schema_extra=_UNSET)
    allowed_token_ids: list[int] | None = Field(None, json_schema_extra=_EMPTY)
    bad_words: list[str] | None = Field(None, json_schema_extra=_EMPTY)
    logprob_token_ids: list[int] | None = Field(None, json_schema_extra=_EMPTY)
    logits_processors: list[Any] | None = Field(None, json_schema_extra=_EMPTY)
    priority: int | None = Field(0, json_schema_extra={"enum": [0, None]})
    cache_salt: str | None = Field(None, json_schema_extra=_UNSET)
    kv_transfer_params: dict[str, Any] | None = Field(None, json_schema_extra=_UNSET)
    vllm_xargs: dict[str, Any] | None = Field(None, json_schema_extra=_UNSET)
    return_tokens_as_token_ids: bool | None = Field(False, json_schema_extra=_OFF)
    return_token_ids: bool | None = Field(False, json_schema_extra=_OFF)
    prompt_embeds: str | list[str] | None = Field(None, json_schema_extra=_UNSET)


class VllmChatFields(_Fields):
    """Chat-only extras that are refused when set."""

    echo: bool | None = Field(False, json_schema_extra=_OFF)
    continue_final_message: bool | None = Field(False, json_schema_extra=_OFF)
    chat_template: str | None = Field(None, json_schema_extra=_UNSET)
    documents: list[dict[str, Any]] | None = Field(None, json_schema_extra=_EMPTY)


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
