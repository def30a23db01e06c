"""OpenAI response bodies: ``chat.completion`` / ``text_completion`` objects, their streamed
chunks as server-sent events, and the two consumers of a ``JobRun`` that build them
(``stream_events``, ``collect``), each choice's text through its tool-call stage first
(``ToolOutput``) when the request has tools.

A stream, as OpenAI sends it (every chunk has one id and ``created``):

    data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, ...}]}
    data: {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}
          (with tools: "delta": {"tool_calls": [...]} too, parsed by ``ToolOutput``)
    data: {"choices": [], "usage": {...}}          only with stream_options.include_usage
                                                   (continuous_usage_stats: on every chunk)
    data: [DONE]

A failure after the first byte cannot change the status any more: it becomes
``data: {"error": {...}}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

from pdserve.gateway.choices import ChoiceUpdate
from pdserve.gateway.errors import error_body
from pdserve.gateway.jobs import Job
from pdserve.gateway.logprobs import LogprobEntry, chat_logprobs, completion_logprobs
from pdserve.gateway.prompt_scores import PromptScores, PromptStream, echo_logprobs
from pdserve.gateway.run import JobRun, Usage
from pdserve.gateway.sse import json_text, sse
from pdserve.gateway.tools.calls import accumulate, delta_json
from pdserve.gateway.tools.output import ToolOutput
from pdserve.protocol.messages import TokenLogprob

SSE_DONE = "data: [DONE]\n\n"

log = logging.getLogger(__name__)


@dataclass
class ChoiceResult:
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _logprobs(job: Job, entries: list[LogprobEntry]) -> dict[str, Any] | None:
    if not job.logprobs:
        return None
    return chat_logprobs(entries) if job.kind == "chat" else completion_logprobs(entries)


def response_body(
    job: Job, results: list[ChoiceResult], usage: Usage, scores: PromptScores | None = None
) -> dict[str, Any]:
    """``scores`` turns the prompts' scores into the response, where the job asks for them."""
    choices = []
    prompt_logprobs = None
    for index, r in enumerate(results):
        choice: dict[str, Any] = {"index": index}
        if job.kind == "chat":
            choice["message"] = {"role": "assistant", "content": r.text}
            if r.tool_calls:  # content null when there is none, as OpenAI sends it
                choice["message"].update(content=r.text or None, tool_calls=r.tool_calls)
        else:
            choice["text"] = r.text
        choice["logprobs"] = _logprobs(job, r.logprobs)
        choice["finish_reason"] = r.finish_reason
        prompt = job.requests[index // job.n].prompt_token_ids
        if scores is not None and job.echo:
            echo = scores.echo(prompt, r.prompt_logprobs)
            choice["text"] = echo.text + r.text
            if job.logprobs:
                choice["logprobs"] = echo_logprobs(echo, r.logprobs)
        if scores is not None and job.prompt_logprobs and r.prompt_logprobs is not None:
            prompt_logprobs = scores.vllm(prompt, r.prompt_logprobs)
            if job.kind == "completion":  # vLLM: a choice's own; chat: the response's
                choice["prompt_logprobs"] = prompt_logprobs
        choices.append(choice)
    body: dict[str, Any] = {
        "id": job.response_id,
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": usage_body(usage),
    }
    if job.kind == "chat" and job.prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs
    if job.system_fingerprint is not None:
        body["system_fingerprint"] = job.system_fingerprint
    return body


def chunk_body(
    job: Job, choices: list[dict[str, Any]], usage: Usage | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": job.response_id,
        "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if job.system_fingerprint is not None:
        body["system_fingerprint"] = job.system_fingerprint
    if job.include_usage:
        body["usage"] = None if usage is None else usage_body(usage)
    return body


class ChunkEvents:
    """A stream's chunks of one choice as SSE events, ``sse(chunk_body(job, [choice], usage))``
    to the byte, with what every chunk repeats (id, object, created, model, ...) encoded once."""

    def __init__(self, job: Job) -> None:
        self.job = job
        text = json_text(chunk_body(job, []))
        # '"choices":[' cannot occur inside a JSON string: its second quote would be escaped
        cut = text.index('"choices":[') + len('"choices":[')
        self._head, self._tail = f"data: {text[:cut]}", f"{text[cut:]}\n\n"

    def event(self, choice: dict[str, Any], usage: Usage | None = None) -> str:
        """``usage``: so far, with ``continuous_usage`` (vLLM's way); None otherwise."""
        if usage is not None:
            return sse(chunk_body(self.job, [choice], usage))
        return f"{self._head}{json_text(choice)}{self._tail}"


def chunk_choice(
    job: Job, update: ChoiceUpdate, first: bool, logprobs: list[LogprobEntry]
) -> dict[str, Any]:
    """One choice of a chunk; ``first`` puts the role in a chat delta."""
    choice: dict[str, Any] = {"index": update.index}
    if job.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if first or update.text:
            delta["content"] = update.text
        if update.tool_calls:
            delta["tool_calls"] = delta_json(update.tool_calls)
        choice["delta"] = delta
    else:
        choice["text"] = update.text
    choice["logprobs"] = _logprobs(job, logprobs)
    choice["finish_reason"] = update.finish_reason
    return choice


async def stream_events(run: JobRun) -> AsyncIterator[str]:
    """The SSE body of a started run; always ends with ``[DONE]``."""
    job = run.job
    started: set[int] = set()
    pending: dict[int, list[LogprobEntry]] = {i: [] for i in range(job.num_choices)}
    tools = ToolOutput.of(job.tools, job.num_choices)
    events = ChunkEvents(job)
    prompts = PromptStream(job, run.tokenizer) if job.echo or job.prompt_logprobs else None
    try:
        async with aclosing(run.updates()) as updates:
            async for update in updates:
                if tools is not None:
                    update = tools.apply(update)
                pending[update.index] += update.logprobs
                first = update.index not in started
                if not (first or update.text or update.tool_calls or update.finish_reason):
                    continue  # text held back (partial character, possible stop string)
                started.add(update.index)
                logprobs, pending[update.index] = pending[update.index], []
                usage = run.usage if job.continuous_usage else None  # so far, vLLM's way
                choice = chunk_choice(job, update, first, logprobs)
                if prompts is not None:
                    prompts.apply(choice, update, logprobs, first)
                yield events.event(choice, usage)
        if job.include_usage:
            yield sse(chunk_body(job, [], run.usage))
    except Exception as e:
        error = error_body(e)
        log.warning("request %s: %d %s", job.response_id, error.status, error.message)
        yield sse(error.body())
    yield SSE_DONE


class BoundedStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` whose client must take each write within ``send_timeout_s``:
    one that stays behind (its socket buffer full that long) is cut off, the connection
    closed, and ``on_cut`` runs (it ends the run). Memory per stream stays bounded by the
    socket buffer and the run's backlog."""

    def __init__(
        self,
        content: AsyncIterator[str],
        *,
        send_timeout_s: float,
        on_cut: Callable[[], Awaitable[None]],
        **kwargs: object,
    ) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self.send_timeout_s = send_timeout_s
        self.on_cut = on_cut

    async def stream_response(self, send: Send) -> None:
        timeout_s = self.send_timeout_s

        async def timed_send(message: Message) -> None:
            async with asyncio.timeout(timeout_s):
                await send(message)

        try:
            await super().stream_response(timed_send)
        except TimeoutError:
            log.warning("a streaming client took no data for %g s: cut off", timeout_s)
            await self.on_cut()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def collect(run: JobRun) -> dict[str, Any]:
    """The non-streaming response body of a started run."""
    results = [ChoiceResult() for _ in range(run.job.num_choices)]
    tools = ToolOutput.of(run.job.tools, run.job.num_choices)
    async with aclosing(run.updates()) as updates:
        async for update in updates:
            if tools is not None:
                update = tools.apply(update)
            result = results[update.index]
            result.text += update.text
            accumulate(result.tool_calls, update.tool_calls)
            result.logprobs += update.logprobs
            result.finish_reason = update.finish_reason or result.finish_reason
            result.prompt_logprobs = result.prompt_logprobs or update.prompt_logprobs
    job = run.job
    scores = PromptScores(run.tokenizer) if job.echo or job.prompt_logprobs else None
    return response_body(job, results, run.usage, scores)
