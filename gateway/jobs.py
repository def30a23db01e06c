"""From a validated OpenAI request to the backend requests that serve it: chat template,
tokenization, context-length checks, sampling parameters.

One request, one name for each thing it is on its way through the gateway::

    ChatCompletionRequest | CompletionRequest   the HTTP body, validated (gateway.openai_models)
      -> Job        this module: the OpenAI request prepared; what to generate (one backend
                    request per prompt) and how to shape the answer (stream, usage, tools)
      -> m.Generate the backend request of one prompt, ``n`` choices: the wire's own message
                    (gateway.backend; the ZMQ backend sends it to the coordinator as it is)
      -> JobRun     one Job being served: its token streams, choices and outcome (gateway.run)
      -> m.TokenChunk in, ChoiceUpdate out (gateway.choices), SSE or a body (gateway.responses)

A prompt's size is checked before it is tokenized whole (``check_prompt_size``): tokenizing a
text costs memory per token (an 8 MiB prompt took the gateway from 66 to 931 MiB), so a text
too long to be short is counted in pieces of ``CHUNK_CHARS`` characters, and refused (400
``context_length_exceeded``) as soon as the count passes the context length: at most about
``max_model_len`` tokens and one piece are ever tokenized for it, whatever its size. A cut
between pieces can split a word into more tokens than it has whole, so each cut allows
``SLACK_PER_CUT`` tokens before the text is refused; a text that passes is then tokenized
whole and checked exactly as before.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal, TypeVar, cast

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import OpenAIError, invalid_request
from pdserve.gateway.openai_models import (
    MAX_PROMPTS,
    AnyRequest,
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
)
from pdserve.gateway.structured import structured_spec
from pdserve.gateway.tools.request import (
    ToolPlan,
    check_messages,
    template_tools,
    tool_plan,
    uses_special_tool_tokens,
)
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHARS_PER_TOKEN = 4  # up to max_model_len * this many characters, tokenize whole at once
CHUNK_CHARS = 16384
WHOLE_CHARS = 4 * CHUNK_CHARS  # and up to this many, whatever the context length
SLACK_PER_CUT = 2
_CUT_WINDOW = 256  # cut at the last whitespace this close to a piece's end


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
    echo: bool = False  # completions: the prompt (and its logprobs) before each choice's text
    prompt_logprobs: bool = False  # vLLM's ``prompt_logprobs`` field in the response
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
        echo=isinstance(req, CompletionRequest) and req.echo,
        prompt_logprobs=req.prompt_logprobs is not None,
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
    try:
        sampling.check_prompt_logprobs(len(ids))
    except ValueError as e:
        echo = isinstance(req, CompletionRequest) and req.echo and req.prompt_logprobs is None
        raise invalid_request(str(e), "logprobs" if echo else "prompt_logprobs") from e
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
            prompt_logprobs=req.requested_prompt_logprobs(),
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


def check_prompt_size(text: str, tokenizer: Tokenizer, max_model_len: int, param: str) -> None:
    """Raise a 400 if ``text`` surely holds more tokens than ``max_model_len``."""
    if max_model_len <= 0 or len(text) <= max(max_model_len * CHARS_PER_TOKEN, WHOLE_CHARS):
        return
    count = cuts = start = 0
    while start < len(text):
        end = _cut(text, start + CHUNK_CHARS)
        count += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        cuts += end < len(text)
        if count > max_model_len + SLACK_PER_CUT * cuts:
            raise too_long(max_model_len, param)
        start = end


def too_long(max_model_len: int, param: str) -> OpenAIError:
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested more than {max_model_len} tokens in the {param}. Please reduce the length "
        f"of the {param}."
    )
    return OpenAIError(400, message, param=param, code="context_length_exceeded")


def _cut(text: str, end: int) -> int:
    """``end``, moved back to just after a whitespace close before it if there is one."""
    if end >= len(text):
        return len(text)
    for i in range(end - 1, max(end - _CUT_WINDOW, 0), -1):
        if text[i].isspace():
            return i + 1
    return end
