"""One ``Job`` served (``JobRun``): submit its prompts, merge their token streams
(``gateway.token_streams.PromptStreams``), feed each choice's state machine, abort what a stop
string ended, and account for it in the metrics (``gateway.metrics.RunMetrics``).

A prompt's backend request is aborted when every one of its choices has ended in the gateway
but the backend has not finished them all (a stop string matched), and whenever the consumer
goes away early (client disconnect), the stream fails, the request runs past its timeout, a
drain ends it (``expire``), nothing arrives from the cluster for ``idle_s``, or more than
``max_backlog`` events wait for a consumer that does not keep up (a slow reader: the requests
are aborted at once, the consumer finds the error after what it has not read yet).

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
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import anyio

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.backend import Backend, BackendError
from pdserve.gateway.choices import ChoiceState, ChoiceUpdate
from pdserve.gateway.errors import OpenAIError, request_timeout, slow_reader, stream_idle
from pdserve.gateway.jobs import Job
from pdserve.gateway.logprobs import TokenTexts
from pdserve.gateway.metrics import GatewayMetrics, Outcome, RunMetrics
from pdserve.gateway.observe.phases import RequestPhases
from pdserve.gateway.observe.tracing import RequestTrace
from pdserve.gateway.token_streams import END, PromptStreams
from pdserve.protocol.messages import TokenChunk
from pdserve.protocol.phases import Phase

log = logging.getLogger(__name__)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class RunListener(Protocol):
    """Told of a run's progress: its completion tokens so far, and its end, once, with the
    usage its response reports (the tenant's rate limits and meter, ``gateway.tenancy``)."""

    def tokens(self, completion_tokens: int) -> None: ...

    async def ended(self, outcome: Outcome, usage: Usage) -> None: ...


class JobRun:
    """One job in flight: owns its choices' states (``choices``, job order: prompt by prompt,
    ``n`` each), the backend requests that may still run (``_open``), its streams, and its
    outcome, counted once."""

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
        listener: RunListener | None = None,
        arrived: float | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        """``timeout_s`` bounds the whole request, from now: submission and every token;
        ``idle_s`` the time between two events from the cluster; ``max_backlog`` the events
        waiting for the consumer. ``arrived``: when its HTTP request came (``clock``; its
        gateway_queue phase starts there, default now); ``trace``: its span, ended with it."""
        self.job = job
        self.tokenizer = tokenizer
        self._listener = listener
        self._backend = backend
        self._clock = clock
        self._arrival = clock()
        self._metrics = RunMetrics(metrics, clock, self._arrival, job.requests[0].model)
        self._http_arrival = self._arrival if arrived is None else arrived
        self._phases = RequestPhases(metrics.phases if metrics else None, job.requests[0].model)
        self._trace = trace
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
        self._submitted: list[AsyncIterator[TokenChunk]] = []  # prompt i's token stream
        self._open: set[int] = set()  # prompts whose backend request may still be running
        self._outcome: Outcome | None = None
        self._timeout_s = timeout_s
        self._expired: tuple[OpenAIError, Outcome] | None = None  # (why, outcome) once expired
        self._streams = PromptStreams(
            clock,
            idle_s,
            max_backlog,
            on_idle=lambda: self.expire(stream_idle(idle_s or 0.0), Outcome.TIMEOUT),
            on_backlog=lambda: self._fall_behind(max_backlog or 0),
        )

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
        except TimeoutError:
            raise request_timeout(self._timeout_s or 0) from None
        self._metrics.admitted(self.usage.prompt_tokens)

    async def _submit_all(self) -> None:
        try:
            for i, request in enumerate(self.job.requests):
                self._open.add(i)  # before submit: a cancelled submit may still have landed
                if i == 0:
                    self._phases.measured(Phase.GATEWAY_QUEUE, self._clock() - self._http_arrival)
                self._submitted.append(await self._backend.submit(request))
        except BaseException:
            await self._abort_open()
            raise

    def _remaining(self) -> float | None:
        if self._timeout_s is None:
            return None
        return max(0.0, self._arrival + self._timeout_s - self._clock())

    def expire(self, error: OpenAIError, outcome: Outcome) -> None:
        """End the run with ``error``, counted as ``outcome``; its requests are aborted."""
        if self._expired is None and not self.closed:
            self._expired = (error, outcome)
            self._streams.queue.put_nowait((-1, error))
            log.warning("request %s: %d %s", self.job.response_id, error.status, error.message)

    def _fall_behind(self, max_backlog: int) -> None:
        """The consumer is too far behind: expire, and abort at once (it may not get to the
        error for long)."""
        self.expire(slow_reader(f"more than {max_backlog} events behind"), Outcome.ERROR)
        for prompt in self._open:
            rid = self.job.requests[prompt].request_id
            asyncio.get_running_loop().create_task(self._backend.abort(rid))

    async def updates(self) -> AsyncGenerator[ChoiceUpdate, None]:
        """Text deltas of every choice until all have finished. Use inside ``aclosing``."""
        queue = self._streams.queue
        self._streams.start(self._submitted)
        timer = self._arm_timeout()
        outcome = Outcome.ABORTED
        try:
            behind = False  # chunks came while the last updates were out: the reader is slower
            while self._open:
                ready, failure = await self._next_updates(behind)
                behind = False
                for update in ready.values():
                    waiting = queue.qsize()
                    yield update
                    behind = behind or queue.qsize() > waiting
                if failure is not None:
                    raise failure
            outcome = Outcome.SUCCESS
        except Exception as e:
            expired = self._expired
            outcome = expired[1] if expired is not None and e is expired[0] else Outcome.ERROR
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._streams.stop_watching()
            await self.close(outcome)

    def _arm_timeout(self) -> asyncio.TimerHandle | None:
        remaining = self._remaining()
        if remaining is None:
            return None
        timeout = request_timeout(self._timeout_s or 0)
        loop = asyncio.get_running_loop()
        return loop.call_later(remaining, self.expire, timeout, Outcome.TIMEOUT)

    async def _next_updates(self, behind: bool) -> tuple[dict[int, ChoiceUpdate], Exception | None]:
        """The next queued item's update, and while ``behind`` those of every item waiting too,
        merged per choice (choice -> its update); a failure after some of them comes back
        beside them, to be raised once they are out."""
        queue = self._streams.queue
        ready: dict[int, ChoiceUpdate] = {}
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
            return ready, e  # after what came before it
        return ready, None

    async def close(self, outcome: Outcome = Outcome.ABORTED) -> None:
        """Stop reading, abort whatever may still run, count the outcome; idempotent, and safe
        while being cancelled. The HTTP layer calls it too, for a stream never iterated."""
        self._streams.stop_all()
        await self._abort_open()
        if self._outcome is not None:
            return
        self._outcome = outcome
        self._metrics.ended(outcome)
        if outcome is Outcome.SUCCESS:
            self._phases.observe()
        self.end_trace(outcome)
        if self._listener is not None:
            with anyio.CancelScope(shield=True):
                await self._listener.ended(outcome, self.usage)

    def end_trace(self, outcome: Outcome) -> None:
        """The gateway's span of the request ends (tracing on; once)."""
        if self._trace is not None:
            attributes = {
                "pdserve.request_id": self.job.requests[0].request_id,
                "pdserve.model": self.job.model,
                "pdserve.outcome": outcome.value,
            }
            self._trace.end(self._clock(), attributes)

    def _take(
        self, prompt: int, item: TokenChunk | BaseException | None, ready: dict[int, ChoiceUpdate]
    ) -> bool:
        """Feed one queued item to its choice, merging the update into ``ready``; raise what
        failed. True when it ended the last open choice of its prompt (to finish)."""
        if isinstance(item, BaseException):
            raise item
        if prompt not in self._open:
            return False
        if item is END:
            rid = self.job.requests[prompt].request_id
            raise BackendError(f"request {rid}: token stream ended before every choice")
        n = self.job.n
        if not 0 <= item.choice < n:
            raise BackendError(f"choice {item.choice} out of range for n={n}")
        if item.num_cached_tokens > self._cached[prompt]:
            self._cached[prompt] = item.num_cached_tokens
        if item.phases and prompt == 0:
            self._phases.reported(item)
        index = prompt * n + item.choice
        update = self.choices[index].add(item)
        if update is not None:
            if update.num_tokens:
                self._metrics.tokens(index, update.num_tokens)
                if self._listener is not None:
                    self._listener.tokens(sum(c.num_tokens for c in self.choices))
            if (earlier := ready.get(index)) is None:
                ready[index] = update
            else:
                earlier.absorb(update)
        return all(c.finished for c in self._prompt_choices(prompt))

    def _prompt_choices(self, prompt: int) -> list[ChoiceState]:
        n = self.job.n
        return self.choices[prompt * n : (prompt + 1) * n]

    async def _finish_prompt(self, prompt: int) -> None:
        self._streams.stop(prompt)
        self._open.discard(prompt)
        if not all(c.backend_finished for c in self._prompt_choices(prompt)):
            await self._backend.abort(self.job.requests[prompt].request_id)

    async def _abort_open(self) -> None:
        """Abort every request that may still run; safe while being cancelled."""
        with anyio.CancelScope(shield=True):
            for prompt in sorted(self._open):
                self._open.discard(prompt)
                # The request is gone either way; an abort failure must not mask the cause.
                with contextlib.suppress(Exception):
                    await self._backend.abort(self.job.requests[prompt].request_id)
