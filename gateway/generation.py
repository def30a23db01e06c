"""Drive one Job through the backend: submit, merge the token streams of its prompts, feed each
choice's state machine, abort what a stop string ended, and account for it in the metrics.

A prompt's backend request is aborted when every one of its choices has ended in the gateway
but the backend has not finished them all (a stop string matched), and whenever the consumer
goes away early (client disconnect), the stream fails, the request runs past its timeout, a
drain ends it (``expire``), nothing arrives from the cluster for ``idle_s`` (the stream-idle
bound: no failure anywhere can leave it silent longer), or more than ``max_backlog`` events
wait for a consumer that does not keep up (a slow reader: the requests are aborted at once,
the consumer finds the error after what it has not read yet).

Each chunk's update is passed on by itself (one SSE event per token as workers send them), also
when several came at once; only when chunks came in while the last updates were out (a reader
slower than the stream: its writes had to wait) is everything then waiting merged, one update
per choice, so a slow reader gets fewer, larger events instead of a growing backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.backend import Backend, BackendError
from pdserve.gateway.choices import ChoiceState, ChoiceUpdate
from pdserve.gateway.errors import OpenAIError, request_timeout, slow_reader, stream_idle
from pdserve.gateway.jobs import Job
from pdserve.gateway.logprobs import TokenTexts
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.protocol.messages import TokenChunk

log = logging.getLogger(__name__)

_END = None  # what a pump puts on the queue when its stream is exhausted
_Item = tuple[int, TokenChunk | BaseException | None]  # (prompt, what its stream gave)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Generation:
    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        job: Job,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float | None = None,
        idle_s: float | None = None,
        max_backlog: int | None = None,
    ) -> None:
        """``timeout_s`` bounds the whole request, from now: submission and every token;
        ``idle_s`` the time between two events from the cluster; ``max_backlog`` the events
        waiting for the consumer."""
        self.job = job
        self._backend = backend
        self._metrics = metrics
        self._clock = clock
        self._arrival = clock()
        texts = TokenTexts(tokenizer) if job.logprobs else None
        self.choices = [
            ChoiceState(
                i,
                tokenizer,
                job.stops,
                job.skip_special_tokens,
                job.requests[i // job.n].prompt_token_ids,
                texts,
            )
            for i in range(job.num_choices)
        ]
        self._cached = [0] * len(job.requests)
        self._streams: list[AsyncIterator[TokenChunk]] = []
        self._open: set[int] = set()  # prompts whose backend request may still be running
        self._first_token_at: float | None = None
        self._last_token_at: dict[int, float] = {}
        self._pumps: list[asyncio.Task[None]] = []
        self._outcome: str | None = None
        self._timeout_s = timeout_s
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._expired: tuple[OpenAIError, str] | None = None  # (why, outcome) once expired
        self._idle_s = idle_s
        self._max_backlog = max_backlog
        self._last_event_at = self._arrival
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def closed(self) -> bool:
        return self._outcome is not None

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=sum(len(r.prompt_token_ids) for r in self.job.requests),
            completion_tokens=sum(c.num_tokens for c in self.choices),
            cached_tokens=sum(self._cached),
        )

    async def start(self) -> None:
        """Submit every prompt; if one is refused, abort the others and raise ``BackendError``
        (or a 504 ``OpenAIError`` when the timeout passes first).

        Outcomes are counted from ``updates`` on; a refusal is counted where it is answered."""
        try:
            await asyncio.wait_for(self._submit_all(), self._remaining())
        except asyncio.TimeoutError:
            raise request_timeout(self._timeout_s or 0) from None
        if self._metrics is not None:
            self._metrics.prompt_tokens.inc(self.usage.prompt_tokens)

    async def _submit_all(self) -> None:
        try:
            for i, request in enumerate(self.job.requests):
                self._open.add(i)  # before submit: a cancelled submit may still have landed
                self._streams.append(await self._backend.submit(request))
        except BaseException:
            await self._abort_open()
            raise

    def _remaining(self) -> float | None:
        if self._timeout_s is None:
            return None
        return max(0.0, self._arrival + self._timeout_s - self._clock())

    def expire(self, error: OpenAIError, outcome: str) -> None:
        """End the generation with ``error``, counted as ``outcome``; its requests are aborted."""
        if self._expired is None and not self.closed:
            self._expired = (error, outcome)
            self._queue.put_nowait((-1, error))
            log.warning("request %s: %d %s", self.job.response_id, error.status, error.message)

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Text deltas of every choice until all have finished. Use inside ``aclosing``."""
        queue = self._queue
        self._pumps = [
            asyncio.create_task(_pump(i, stream, queue, self._on_pumped))
            for i, stream in enumerate(self._streams)
        ]
        self._last_event_at = self._clock()
        if self._idle_s is not None:
            self._idle_timer = asyncio.get_running_loop().call_later(self._idle_s, self._check_idle)
        remaining = self._remaining()
        timer = None
        if remaining is not None:
            timeout = request_timeout(self._timeout_s or 0)
            timer = asyncio.get_running_loop().call_later(
                remaining, self.expire, timeout, "timeout"
            )
        outcome = "aborted"
        try:
            behind = False  # chunks came while the last updates were out: the reader is slower
            while self._open:
                ready: dict[int, ChoiceUpdate] = {}  # choice -> its update, merged
                failure: Exception | None = None
                try:
                    prompt, item = await queue.get()
                    if self._take(prompt, item, ready):
                        await self._finish_prompt(prompt)
                    while behind and self._open and not queue.empty():
                        prompt, item = queue.get_nowait()
                        if self._take(prompt, item, ready):
                            await self._finish_prompt(prompt)
                except Exception as e:
                    if not ready:
                        raise
                    failure = e  # after what came before it
                behind = False
                for update in ready.values():
                    waiting = queue.qsize()
                    yield update
                    behind = behind or queue.qsize() > waiting
                if failure is not None:
                    raise failure
            outcome = "success"
        except Exception as e:
            expired = self._expired
            outcome = expired[1] if expired is not None and e is expired[0] else "error"
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            await self.close(outcome)

    def _on_pumped(self) -> bool:
        """A pump queued an event; False stops it (the consumer is too far behind)."""
        self._last_event_at = self._clock()
        if self._max_backlog is None or self._queue.qsize() <= self._max_backlog:
            return True
        self.expire(slow_reader(f"more than {self._max_backlog} events behind"), "error")
        for pump in self._pumps:
            pump.cancel()
        for prompt in self._open:  # at once: the consumer may not get to the error for long
            rid = self.job.requests[prompt].request_id
            asyncio.get_running_loop().create_task(self._backend.abort(rid))
        return False

    def _check_idle(self) -> None:
        idle_s = self._idle_s or 0.0
        quiet = self._clock() - self._last_event_at
        if quiet >= idle_s:
            self.expire(stream_idle(idle_s), "timeout")
        else:
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(idle_s - quiet, self._check_idle)

    async def close(self, outcome: str = "aborted") -> None:
        """Stop reading, abort whatever may still run, count the outcome; idempotent, and safe
        while being cancelled. The HTTP layer calls it too, for a stream never iterated."""
        for pump in self._pumps:
            pump.cancel()
        await self._abort_open()
        if self._outcome is not None:
            return
        self._outcome = outcome
        if self._metrics is not None:
            self._metrics.requests.inc(outcome=outcome)
            if outcome == "success":
                self._metrics.e2e.observe(self._clock() - self._arrival)

    def _take(
        self, prompt: int, item: TokenChunk | BaseException | None, ready: dict[int, ChoiceUpdate]
    ) -> bool:
        """Feed one queued item to its choice, merging the update into ``ready``; raise what
        failed. True when it ended the last open choice of its prompt (to finish)."""
        if isinstance(item, BaseException):
            raise item
        if prompt not in self._open:
            return False
        if item is _END:
            rid = self.job.requests[prompt].request_id
            raise BackendError(f"request {rid}: token stream ended before every choice")
        n = self.job.n
        if not 0 <= item.choice < n:
            raise BackendError(f"choice {item.choice} out of range for n={n}")
        if item.num_cached_tokens > self._cached[prompt]:
            self._cached[prompt] = item.num_cached_tokens
        index = prompt * n + item.choice
        update = self.choices[index].add(item)
        if update is not None:
            if update.num_tokens:
                self._observe_tokens(index, update.num_tokens)
            if (earlier := ready.get(index)) is None:
                ready[index] = update
            else:
                earlier.absorb(update)
        return self._prompt_done(prompt)

    def _observe_tokens(self, index: int, num_tokens: int) -> None:
        if self._metrics is None:
            return
        now = self._clock()
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.ttft.observe(now - self._arrival)
        # The tokens of one update share the time since the choice's previous update; after
        # the choice's first token, its batch-mates arrived with it (out-of-order arrivals).
        last = self._last_token_at.get(index)
        gaps = (
            [0.0] * (num_tokens - 1) if last is None else [(now - last) / num_tokens] * num_tokens
        )
        for gap in gaps:
            self._metrics.itl.observe(gap)
        self._last_token_at[index] = now
        self._metrics.generation_tokens.inc(num_tokens)

    def _prompt_done(self, prompt: int) -> bool:
        n = self.job.n
        return all(c.finished for c in self.choices[prompt * n : (prompt + 1) * n])

    async def _finish_prompt(self, prompt: int) -> None:
        n = self.job.n
        self._pumps[prompt].cancel()
        self._open.discard(prompt)
        if not all(c.backend_finished for c in self.choices[prompt * n : (prompt + 1) * n]):
            await self._backend.abort(self.job.requests[prompt].request_id)

    async def _abort_open(self) -> None:
        """Abort every request that may still run; safe while being cancelled."""
        with anyio.CancelScope(shield=True):
            for prompt in sorted(self._open):
                self._open.discard(prompt)
                # The request is gone either way; an abort failure must not mask the cause.
                with contextlib.suppress(Exception):
                    await self._backend.abort(self.job.requests[prompt].request_id)


async def _pump(
    prompt: int,
    stream: AsyncIterator[TokenChunk],
    queue: asyncio.Queue[_Item],
    pumped: Callable[[], bool],
) -> None:
    try:
        async for event in stream:
            queue.put_nowait((prompt, event))
            if not pumped():
                return
        queue.put_nowait((prompt, _END))
    except Exception as e:
        queue.put_nowait((prompt, e))
