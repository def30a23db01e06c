"""From a validated OpenAI request to the backend requests that serve it: chat template,
tokenization, context-length checks, sampling parameters.

One request, one name for each thing it is on its way through the gateway::

    ChatCompletionRequest | CompletionRequest   the HTTP body, validated (gateway.openai_models)
      -> Job        this module: the OpenAI request prepared; what to generate (one backend
                    request per prompt) and how to shape the answer (stream, usage, tools)
      -> m.Generate the backend request of one prompt, ``n`` choices: the wire's own message
                    (gateway.backend; the ZMQ backend sends it to the coordinator as it is)
      -> JobRun     one Job being served: its token streams, choices and outcome (gateway.run)
      -> m.TokenChunk in, ChoiceUpdate out (gateway.choices), SSE or a body (gateway.stream)
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal, cast

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import OpenAIError, invalid_request
from pdserve.gateway.openai_models import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
    sampling_params,
)
from pdserve.gateway.prompt_guard import check_prompt_size
from pdserve.gateway.tools.request import (
    ToolPlan,
    check_messages,
    template_tools,
    tool_plan,
    uses_special_tool_tokens,
)
from pdserve.protocol import messages as m

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Job:
    """One OpenAI request, prepared: one backend request per prompt, ``n`` choices each, and
    how the response is shaped. Frozen: the ``JobRun`` serving it holds what changes."""

    kind: Literal["chat", "completion"]
    response_id: str
    model: str
    requests: list[m.Generate]
    n: int = 1
    stops: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far on every chunk (vLLM)
    system_fingerprint: str | None = None
    tools: ToolPlan | None = None  # how the output becomes tool calls (chat with tools)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n


def prepare_chat(
    req: ChatCompletionRequest,
    tokenizer: Tokenizer,
    model: m.ServedModel,
    tool_parser: str = "auto",
) -> Job:
    """``tool_parser``: ``--tool-call-parser`` (``gateway.tools.request``)."""
    check_supported(req)
    extra = dict(req.chat_template_kwargs or {})
    messages, tools = req.template_messages(), template_tools(req)
    try:
        template = tokenizer.template_for(tools)
        plan = tool_plan(req, template, tool_parser)
        check_messages(messages, template)
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, tools=tools, **extra
        )
    except (ValueError, TypeError) as e:
        raise invalid_request(str(e), "messages") from e
    _check_text(text, "messages")
    check_prompt_size(text, tokenizer, model.max_model_len, "messages")
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    max_tokens = _max_tokens(len(ids), req.requested_max_tokens(), None, model, "messages")
    request = _request(response_id, req, tokenizer, ids, max_tokens)
    job = _job("chat", response_id, req, [request])
    if plan is None:
        return job
    # vLLM's hermes parser likewise keeps special tokens when <tool_call> is one
    skip = job.skip_special_tokens and not uses_special_tool_tokens(plan, tokenizer)
    return dataclasses.replace(job, tools=plan, skip_special_tokens=skip)


def prepare_completion(req: CompletionRequest, tokenizer: Tokenizer, model: m.ServedModel) -> Job:
    check_supported(req)
    prompts = _prompt_ids(req, tokenizer, model.max_model_len)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    requests = []
    for i, ids in enumerate(prompts):
        max_tokens = _max_tokens(
            len(ids), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, model, "prompt"
        )
        request_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"
        requests.append(_request(request_id, req, tokenizer, ids, max_tokens))
    return _job("completion", response_id, req, requests)


def _job(
    kind: Literal["chat", "completion"],
    response_id: str,
    req: ChatCompletionRequest | CompletionRequest,
    requests: list[m.Generate],
) -> Job:
    return Job(
        kind=kind,
        response_id=response_id,
        model=req.model,
        requests=requests,
        n=req.n,
        stops=req.stop_strings(),
        skip_special_tokens=req.skip_special_tokens,
        logprobs=req.requested_logprobs() is not None,
        stream=req.stream,
        include_usage=req.include_usage,
        continuous_usage=req.continuous_usage,
    )


def _request(
    request_id: str,
    req: ChatCompletionRequest | CompletionRequest,
    tokenizer: Tokenizer,
    ids: list[int],
    max_tokens: int,
) -> m.Generate:
    sampling = sampling_params(req, max_tokens)
    _check_ids(sampling.stop_token_ids, tokenizer, "stop_token_ids")
    return m.Generate(
        request_id=request_id,
        model=req.model,
        prompt_token_ids=ids,
        sampling=sampling,
        n=req.n,
        stream_address="",  # the backend's own, filled in there
    )


def _prompt_ids(
    req: CompletionRequest, tokenizer: Tokenizer, max_model_len: int
) -> list[list[int]]:
    given = [req.prompt] if isinstance(req.prompt, str) else req.prompt
    if not given:
        raise invalid_request("prompt must not be empty", "prompt")
    # validated as one of Prompt's shapes: all ints is one prompt given as token ids
    prompts: list[str] | list[list[int]]
    if all(isinstance(p, int) for p in given):
        prompts = [cast("list[int]", given)]
    else:
        prompts = cast("list[str] | list[list[int]]", given)
    if len(prompts) > MAX_PROMPTS:
        message = f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}"
        raise invalid_request(message, "prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            _check_text(p, "prompt")
            check_prompt_size(p, tokenizer, max_model_len, "prompt")
            ids = tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
        else:
            ids = list(p)
        if not ids:
            raise invalid_request("prompt must not be empty", "prompt")
        _check_ids(ids, tokenizer, "prompt")
        out.append(ids)
    return out


def _check_text(text: str, param: str) -> None:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        surrogate = ord(text[e.start])
        message = f"{param} is not valid Unicode: it holds a lone surrogate (\\u{surrogate:04x})"
        raise invalid_request(message, param) from None


def _check_ids(ids: list[int], tokenizer: Tokenizer, param: str) -> None:
    bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if bad:
        message = f"token id {bad[0]} is outside the vocabulary (size {tokenizer.vocab_size})"
        raise invalid_request(message, param)


def _max_tokens(
    prompt_len: int, requested: int | None, default: int | None, model: m.ServedModel, param: str
) -> int:
    """``requested``, else ``default`` capped by the room left, else all the room left."""
    room = model.max_model_len - prompt_len
    if room < 1 or (requested is not None and requested > room):
        asked = f"{prompt_len + (requested or 0)} tokens ({prompt_len} in the {param}"
        asked += f", {requested} in the completion)" if requested is not None else ")"
        message = (
            f"This model's maximum context length is {model.max_model_len} tokens. "
            f"However, you requested {asked}. Please reduce the length of the {param}"
            + (" or completion." if requested is not None else ".")
        )
        raise OpenAIError(400, message, param=param, code="context_length_exceeded")
    if requested is not None:
        return requested
    return room if default is None else min(default, room)
