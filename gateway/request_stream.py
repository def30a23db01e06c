"""A request's side of the gateway's ZMQ backend: what its queue holds until every choice is
accepted (``until_accepted``), then each choice's chunks in order, resumed elsewhere when a
worker dies mid-stream (``choice_events``). The backend routes messages into ``Pending.queue``;
nothing here touches a socket."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from pdserve.gateway.backend import BackendError
from pdserve.gateway.reorder import ChoiceOrder
from pdserve.protocol import messages as m
from pdserve.protocol.codec import encode

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")
Item = m.TokenChunk | m.RequestError | m.Accepted | BackendError  # on a request's queue


@dataclass
class Pending:
    queue: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    early: list[Item] = field(default_factory=list)  # what came before acceptance did
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
