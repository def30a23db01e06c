"""The token streams of a job, from the backend's socket to the ``JobRun``'s queue::

    ZmqBackend routes a request's messages ──▶ Pending.queue            (one per prompt)
      until_accepted      every choice's Accepted, or the refusal: ``submit`` returns
      choice_events       each choice's chunks through a ChoiceOrder (in index order, each
                          token once), resumed elsewhere when a worker dies mid-stream
      ──▶ the prompt's token stream (``Backend.submit``'s iterator)
    PromptStreams         a pump per prompt stream, merged onto one queue in arrival order,
                          watched for silence and backlog ──▶ the ``JobRun``

Nothing here touches a socket: the backend routes messages into ``Pending.queue`` and sends
what ``choice_events`` hands it; the run reads ``PromptStreams.queue``.

**Order.** Chunks reach the gateway from two senders per choice (token 0 from the prefill
worker, 1.. from the decode worker) and, after a migration, from a new decode worker that may
repeat what the dead one sent; so a chunk may come before one with a lower index, twice, or
after the end::

    arrives     [3,4]  [1,2]  [0]                [1,2]   [5 final]  [6]
    passed on   -      -      [0] [1,2] [3,4]    -       [5 final]  -
                held   held   the gap fills      repeat  the end    after the end

    (a chunk drawn as its token indices)

``ChoiceOrder`` is the one place the gateway reorders: a backend's job (``gateway.backend``
states the contract), because only the backend knows what a repeat is: it resumes a migrated
choice after the tokens released so far (``token_ids``) and drops the held ones the new worker
sends again (``restart``). Every backend, the ZMQ client and the tests' fake alike, runs its
chunks through it, so the per-choice text state (``gateway.choices``) only checks the order.

**Watches.** A pump puts each chunk on the queue tagged with its prompt, then ``END`` once its
stream is exhausted, or what it raised. Nothing from any stream for ``idle_s`` calls
``on_idle`` (the stream-idle bound: no failure anywhere can leave a request silent longer);
more than ``max_backlog`` events waiting for a consumer that does not keep up stops every pump
and calls ``on_backlog`` (a slow reader).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from pdserve.gateway.backend import BackendError
from pdserve.protocol import messages as m
from pdserve.protocol.codec import encode

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")
RequestItem = m.TokenChunk | m.RequestError | m.Accepted | BackendError  # on a request's queue
END = None  # what a pump puts on the queue when its stream is exhausted
PromptItem = tuple[int, m.TokenChunk | BaseException | None]  # (prompt, what it gave); -1: none


class ChoiceOrder:
    """One choice's chunks in, the chunks ready to pass on out, in index order.

    A chunk is passed on whole or not at all: one that starts before the next index (a repeat)
    is dropped, one that starts after it is held until the gap fills. Nothing is passed on after
    the final chunk. A gap never filled holds its chunks until the stream ends or fails: the
    caller's timeouts (stream idle, request) end such a choice."""

    __slots__ = ("done", "held", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []  # passed on so far, in order
        self.held: dict[int, m.TokenChunk] = {}  # index -> chunk, ahead of the next index
        self.done = False  # the final chunk was passed on

    def push(self, chunk: m.TokenChunk) -> list[m.TokenChunk]:
        """The chunks ready now, in order (often ``[chunk]``; empty while a gap is open)."""
        index, ids = chunk.index, self.token_ids
        if self.done or index < len(ids) or not (chunk.token_ids or chunk.finished):
            return []  # after the end, a repeat, or nothing to pass on
        if index > len(ids):
            self.held.setdefault(index, chunk)  # the first to come stays: a repeat is dropped
            return []
        ids += chunk.token_ids
        self.done = chunk.finished
        if not self.held:
            return [chunk]
        ready = [chunk]
        while not self.done and (nxt := self.held.pop(len(ids), None)) is not None:
            ids += nxt.token_ids
            self.done = nxt.finished
            ready.append(nxt)
        if self.done:
            self.held.clear()
        elif self.held:  # chunks a longer one overlapped: repeats now
            self.held = {i: c for i, c in self.held.items() if i > len(ids)}
        return ready

    def restart(self) -> None:
        """The choice moves to another worker, which sends again everything after
        ``token_ids``: what is held is dropped."""
        self.held.clear()


@dataclass
class Pending:
    """One request in flight at the ZMQ backend: what its messages are routed to."""

    queue: asyncio.Queue[RequestItem] = field(default_factory=asyncio.Queue)
    early: list[RequestItem] = field(default_factory=list)  # what came before acceptance did
    answered: bool = False  # something (a chunk or an error) is on its way to the consumer
    last_at: float = 0.0  # when the last message for it arrived (or it was sent)


def check_finish(chunk: m.TokenChunk) -> None:
    """A chunk that ends its choice without a reason the app knows (an abort the gateway never
    asked for) fails the request, wherever it falls in the choice's order."""
    if chunk.finished and chunk.finish_reason not in FINISH_REASONS:
        reason = chunk.finish_reason
        what = "was aborted by the cluster" if reason == "abort" else f"ended with {reason!r}"
        raise BackendError(f"request {chunk.request_id} choice {chunk.choice} {what}", 503)


async def until_accepted(request: m.Generate, pending: Pending) -> None:
    """Wait for every choice's ``Accepted``; raise a refusal as ``BackendError``. A token or a
    worker failure arriving first means the request was taken: it is kept for the stream."""
    accepted: set[int] = set()
    while len(accepted) < request.n:
        item = await pending.queue.get()
        if isinstance(item, m.Accepted):
            accepted.add(item.choice)
        elif isinstance(item, BackendError):
            raise item
        elif isinstance(item, m.RequestError) and not item.retryable:
            raise BackendError(item.message, item.status)
        else:
            pending.early.append(item)
            return


async def choice_events(
    request: m.Generate,
    pending: Pending,
    send: Callable[[list[bytes]], Awaitable[bool]],
    max_migrations: int,
) -> AsyncIterator[m.TokenChunk]:
    """Each choice's chunks in token order. A choice whose worker died mid-stream (a retryable
    error) resumes on another worker after the tokens already passed on (``send`` carries the
    resumed ``Generate``), up to ``max_migrations`` times; the stream goes on with no gap or
    repeat in its indices."""
    rid, n = request.request_id, request.n
    streams = [ChoiceOrder() for _ in range(n)]
    migrations = [0] * n
    while not all(st.done for st in streams):
        item = pending.early.pop(0) if pending.early else await pending.queue.get()
        if isinstance(item, m.Accepted):
            continue  # a choice placed again after its worker was lost
        if isinstance(item, BackendError):
            raise item
        if isinstance(item, m.RequestError):
            c = item.choice
            if not (
                item.retryable and c is not None and 0 <= c < n and migrations[c] < max_migrations
            ):
                raise BackendError(item.message, item.status)
            migrations[c] += 1
            log.warning(
                "request %s choice %d: %s; resuming after %d tokens (%d/%d)",
                rid,
                c,
                item.message,
                len(streams[c].token_ids),
                migrations[c],
                max_migrations,
            )
            streams[c].restart()  # the new worker sends what is held again
            resume = dataclasses.replace(
                request, resume_choice=c, resume_token_ids=list(streams[c].token_ids)
            )
            if not await send(encode(resume)):
                raise BackendError(item.message, item.status)
            continue
        check_finish(item)
        if not 0 <= item.choice < n:
            raise BackendError(f"request {rid}: choice {item.choice} but n={n}", 500)
        for ready in streams[item.choice].push(item):
            yield ready


class PromptStreams:
    """Owns a job's queue, the pump tasks that fill it, and the idle and backlog watches."""

    def __init__(
        self,
        clock: Callable[[], float],
        idle_s: float | None,
        max_backlog: int | None,
        on_idle: Callable[[], None],
        on_backlog: Callable[[], None],
    ) -> None:
        self.queue: asyncio.Queue[PromptItem] = asyncio.Queue()
        self._clock = clock
        self._idle_s = idle_s
        self._max_backlog = max_backlog
        self._on_idle = on_idle
        self._on_backlog = on_backlog
        self._pumps: list[asyncio.Task[None]] = []
        self._last_event_at = 0.0  # set by start
        self._idle_timer: asyncio.TimerHandle | None = None

    def start(self, streams: list[AsyncIterator[m.TokenChunk]]) -> None:
        """Pump every stream (prompt ``i`` is ``streams[i]``) and start the idle watch."""
        self._pumps = [
            asyncio.create_task(_pump(i, stream, self.queue, self._pumped))
            for i, stream in enumerate(streams)
        ]
        self._last_event_at = self._clock()
        if self._idle_s is not None:
            self._idle_timer = asyncio.get_running_loop().call_later(self._idle_s, self._check_idle)

    def stop(self, prompt: int) -> None:
        self._pumps[prompt].cancel()

    def stop_all(self) -> None:
        for pump in self._pumps:
            pump.cancel()

    def stop_watching(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()

    def _pumped(self) -> bool:
        """A pump queued an event; False stops it (the consumer is too far behind)."""
        self._last_event_at = self._clock()
        if self._max_backlog is None or self.queue.qsize() <= self._max_backlog:
            return True
        self._on_backlog()
        self.stop_all()
        return False

    def _check_idle(self) -> None:
        idle_s = self._idle_s or 0.0
        quiet = self._clock() - self._last_event_at
        if quiet >= idle_s:
            self._on_idle()
        else:
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(idle_s - quiet, self._check_idle)


async def _pump(
    prompt: int,
    stream: AsyncIterator[m.TokenChunk],
    queue: asyncio.Queue[PromptItem],
    pumped: Callable[[], bool],
) -> None:
    try:
        async for event in stream:
            queue.put_nowait((prompt, event))
            if not pumped():
                return
        queue.put_nowait((prompt, END))
    except Exception as e:
        queue.put_nowait((prompt, e))
