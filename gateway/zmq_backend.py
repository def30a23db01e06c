"""The gateway's ``Backend`` over ZeroMQ: requests go to the coordinator, tokens come straight
back from the workers::

    gateway PUSH ── Generate, Abort, GatewayHello (every hello_interval_s) ──▶ coordinator inbox
    gateway PULL (stream_address) ◀── TokenBatch (a worker step's TokenChunks for this gateway):
                                      prefill worker (index 0), decode worker (1..)
                                  ◀── Accepted, ClusterState (coordinator)
                                  ◀── RequestError (coordinator or a worker)

each from a key of the role that sends it (``protocol.roles``: a worker's key cannot send a
``ClusterState``); anything else is refused and logged.

``submit`` returns once the coordinator has accepted every choice (decode blocks reserved,
prefill job sent: milliseconds, however long the prefill queue) or raises its refusal, so a
refused request, streamed or not, is answered with its own status (503 and ``Retry-After``
when no decode worker has room), never a 200 followed by an error event.

Each request in flight has a queue; the receive loop routes its chunks and errors there and drops
anything else (malformed frames, chunks of requests already over or aborted). Each choice's
chunks go through a ``ChoiceOrder`` (``gateway.token_streams``): the stream passes them on in
index order, each token once, and ends once every choice has had its finished chunk *and* every
token before it (token 0 comes from another socket than the decode worker's last chunk and may
arrive after it).

With the coordinator gone (no ``ClusterState`` for ``state_timeout_s``), a request nothing
has answered fails (503), and so does one that has had no message for as long: it waits on
something only the coordinator could pass on (a ``TransferDone``, an ``Accepted``). Streams
still decoding go on to their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from pdserve.gateway.backend import Backend, BackendError
from pdserve.gateway.token_streams import Pending, choice_events, until_accepted
from pdserve.protocol import messages as m
from pdserve.protocol.checks import ProtocolError
from pdserve.protocol.codec import decode, encode
from pdserve.protocol.roles import Receiver
from pdserve.runtime import security
from pdserve.runtime.gate import RoleGate
from pdserve.runtime.sockets import bound_address, make_socket, sender_of

log = logging.getLogger(__name__)

RESTART_QUIET_S = 1.0  # a stream quiet this long when the coordinator restarts waits on it


class ZmqBackend(Backend):
    """The cluster over ZeroMQ: owns the two sockets, the requests in flight (a ``Pending`` each,
    by request id) and the coordinator's last ``ClusterState``."""

    def __init__(
        self,
        coordinator_address: str,
        stream_bind: str = "tcp://127.0.0.1:0",
        *,
        hello_interval_s: float = 1.0,
        state_timeout_s: float = 3.0,
        max_migrations: int = 3,
        clock: Callable[[], float] = time.monotonic,
        samples: Callable[[], list[m.LatencySamples]] = list,
    ) -> None:
        """``stream_bind`` is where workers and the coordinator reach this gateway; ``:0``
        picks a free port (``stream_address`` holds the bound address once started). The
        cluster counts as gone when no ``ClusterState`` came for ``state_timeout_s``.
        ``samples``: the latencies each hello carries to the planner (taken, then empty)."""
        self.samples = samples
        self.coordinator_address = coordinator_address
        self.stream_bind = stream_bind
        self.stream_address = ""
        self.hello_interval_s = hello_interval_s
        self.state_timeout_s = state_timeout_s
        self.max_migrations = max_migrations
        self._clock = clock
        self._ctx: zmq.asyncio.Context | None = None
        self._coordinator: zmq.asyncio.Socket | None = None
        self._stream: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[str, Pending] = {}
        self._embeds: dict[str, asyncio.Future[m.EmbedResult]] = {}  # by request id
        self._state: m.ClusterState | None = None
        self._state_at: float | None = None

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the stream socket, connect to the coordinator, start the receive and hello loops
        (in the running event loop: the server's)."""
        # CURVE on both sockets with the keys `pdserve gateway --keys` exported (none: plain)
        self._ctx = security.async_context(security.from_env())
        # tokens from worker keys only, the cluster's state from the coordinator's
        self.gate = RoleGate(security.security_of(self._ctx), Receiver.GATEWAY)
        try:
            self._stream = make_socket(self._ctx, zmq.PULL, self.stream_bind, bind=True)
            self.stream_address = bound_address(self._stream)
            # IMMEDIATE: with no live connection a send fails at once (503), never queues.
            # No high-water mark: a live but busy coordinator must never lose an Abort.
            options: dict[int, int] = {zmq.IMMEDIATE: 1, zmq.SNDHWM: 0}
            self._coordinator = make_socket(
                self._ctx, zmq.PUSH, self.coordinator_address, bind=False, options=options
            )
        except OSError:
            await self.close()
            raise
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="gateway-receive"),
            asyncio.create_task(self._hello_loop(), name="gateway-hello"),
        ]
        for task in self._tasks:
            task.add_done_callback(_log_crash)
        log.info("token stream at %s", self.stream_address)

    async def close(self) -> None:
        """Stop the loops, fail every request still waiting (503), close the sockets."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for pending in self._pending.values():
            pending.queue.put_nowait(BackendError("the gateway is shutting down", 503))
        self._pending.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._ctx = self._coordinator = self._stream = None

    # ---- Backend -----------------------------------------------------------------------------

    async def submit(self, request: m.Generate) -> AsyncIterator[m.TokenChunk]:
        rid = request.request_id
        if self._coordinator is None:
            raise BackendError("the gateway is not connected to a coordinator", 503)
        if rid in self._pending:
            raise BackendError(f"request id {rid} is already in flight", 500)
        generate = dataclasses.replace(request, stream_address=self.stream_address)
        try:
            frames = encode(generate)
        except ProtocolError as e:
            raise BackendError(f"request {rid} cannot be sent: {e}", 500) from e
        # before sending: no chunk may beat it
        pending = self._pending[rid] = Pending(last_at=self._clock())
        if not await self._send(frames):
            del self._pending[rid]
            raise BackendError(f"the coordinator at {self.coordinator_address} is unreachable", 503)
        try:
            await until_accepted(generate, pending)
        except BaseException:
            if self._pending.get(rid) is pending:
                del self._pending[rid]
            raise
        return self._events(generate, pending)

    async def embed(self, request: m.Embed, timeout_s: float | None) -> m.EmbedResult:
        rid = request.request_id
        if self._coordinator is None:
            raise BackendError("the gateway is not connected to a coordinator", 503)
        embed = dataclasses.replace(request, stream_address=self.stream_address)
        result: asyncio.Future[m.EmbedResult] = asyncio.get_running_loop().create_future()
        self._embeds[rid] = result
        try:
            if not await self._send(encode(embed)):
                address = self.coordinator_address
                raise BackendError(f"the coordinator at {address} is unreachable", 503)
            async with asyncio.timeout(timeout_s):
                return await result
        except TimeoutError:
            await self._send(encode(m.Abort(rid, "timeout")))
            raise BackendError(f"no embeddings within {timeout_s:g} s", 504) from None
        finally:
            self._embeds.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        """Always tells the coordinator (the stream may have ended here while the workers still
        run, e.g. after a stop string); it must ignore ids it no longer knows."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:  # wakes a consumer still waiting on it
            pending.queue.put_nowait(BackendError(f"request {request_id} was aborted", 500))
        if not await self._send(encode(m.Abort(request_id, "gateway"))):
            log.warning("abort of %s not sent: the coordinator is unreachable", request_id)

    def models(self) -> list[m.ServedModel]:
        return [] if self._state is None else [s for s in self._state.models if s.ready]

    def model_roots(self) -> dict[str, str]:
        """name -> model directory of every model the cluster names, ready or not."""
        return {} if self._state is None else {s.name: s.root for s in self._state.models}

    def health(self) -> bool:
        return (
            self._fresh() and self._state is not None and any(s.ready for s in self._state.models)
        )

    def worker_stats(self) -> list[m.WorkerStatus]:
        return [] if self._state is None else list(self._state.workers)

    def routing_decisions(self) -> dict[str, int]:
        return {} if self._state is None else dict(self._state.routing)

    def plans(self) -> list[m.PlanReport]:
        return [] if self._state is None else list(self._state.plans)

    def rollouts(self) -> list[m.Rollout]:
        return [] if self._state is None else list(self._state.rollouts)

    # ---- internals ---------------------------------------------------------------------------

    async def _events(self, request: m.Generate, pending: Pending) -> AsyncIterator[m.TokenChunk]:
        try:
            async for chunk in choice_events(request, pending, self._send, self.max_migrations):
                yield chunk
        finally:
            if self._pending.get(request.request_id) is pending:
                del self._pending[request.request_id]

    async def _send(self, frames: list[bytes]) -> bool:
        """False when no connection to the coordinator is up (or the backend is closed)."""
        if self._coordinator is None:
            return False
        try:
            await self._coordinator.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def _receive_loop(self) -> None:
        stream = self._stream
        while stream is not None:
            try:
                frames = await stream.recv_multipart(copy=False)
            except zmq.Again:
                # pyzmq's asyncio socket may wake with nothing to read yet (seen with large
                # out-of-band frames): no part was taken (a message's parts arrive together),
                # so wait again; ending here would leave every stream of this gateway silent
                log.debug("the token stream woke with nothing to read")
                continue
            try:
                msg = decode([f.buffer for f in frames])
                if self.gate.admit(msg, sender_of(frames[0])):
                    self._dispatch(msg)
            except ProtocolError as e:
                log.warning("dropped a bad message on the token stream: %s", e)
            except Exception:  # a bug must not stop every other request's tokens
                log.exception("dropped a message the gateway could not handle")

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.ClusterState):
            before = self._state.coordinator_id if self._state is not None else ""
            self._state, self._state_at = msg, self._clock()
            if before and msg.coordinator_id != before:
                self._fail_waiting_on_lost_coordinator()
        elif isinstance(msg, m.TokenBatch):
            for chunk in msg.chunks:
                self._route(chunk)
        elif isinstance(msg, m.EmbedResult):
            waiting = self._embeds.get(msg.request_id)
            if waiting is not None and not waiting.done():
                waiting.set_result(msg)
        elif isinstance(msg, m.RequestError) and msg.request_id in self._embeds:
            waiting = self._embeds[msg.request_id]
            if not waiting.done():
                waiting.set_exception(BackendError(msg.message, msg.status))
        elif isinstance(msg, (m.RequestError, m.Accepted)):
            self._route(msg)
        else:
            log.warning("dropped an unexpected %s on the token stream", type(msg).__name__)

    def _route(self, msg: m.TokenChunk | m.RequestError | m.Accepted) -> None:
        pending = self._pending.get(msg.request_id)
        if pending is None:  # over, aborted, or never ours
            return
        pending.answered = True
        pending.last_at = self._clock()
        pending.queue.put_nowait(msg)

    async def _hello_loop(self) -> None:
        while True:
            hello = encode(m.GatewayHello(self.stream_address, self.samples()))
            if not await self._send(hello):
                log.debug("no connection to the coordinator at %s yet", self.coordinator_address)
            self._fail_unanswered()
            # unhealthy (starting, or the coordinator lost): asked again soon, so that the
            # first model ready is served within a tenth of a second rather than a period
            ready = self.health()
            await asyncio.sleep(self.hello_interval_s if ready else min(self.hello_interval_s, 0.1))

    def _fail_unanswered(self) -> None:
        """With the coordinator silent, a request nothing has answered yet never will be, and
        one that has heard nothing for as long waits on something only it could pass on."""
        if self._fresh():
            return
        now = self._clock()
        for rid, pending in list(self._pending.items()):
            if not pending.answered:
                message = f"no answer from the coordinator for request {rid}"
            elif now - pending.last_at > self.state_timeout_s:
                quiet = now - pending.last_at
                message = (
                    f"request {rid} lost: the coordinator at {self.coordinator_address} is "
                    f"unreachable and the request made no progress for {quiet:.0f} s"
                )
            else:
                continue
            log.warning("%s", message)
            del self._pending[rid]  # what comes for it later is dropped
            pending.answered = True
            pending.queue.put_nowait(BackendError(message, 503))

    def _fail_waiting_on_lost_coordinator(self) -> None:
        """A new coordinator knows none of the requests in flight: those still waiting on it
        (no answer yet, or quiet since token 0, their KV hand-off passed through the old one)
        fail now; streams whose tokens flow from a decode worker go on."""
        now = self._clock()
        for rid, pending in list(self._pending.items()):
            if pending.answered and now - pending.last_at <= RESTART_QUIET_S:
                continue
            message = f"request {rid} lost: the coordinator at {self.coordinator_address} restarted"
            log.warning("%s", message)
            del self._pending[rid]
            pending.answered = True
            pending.queue.put_nowait(BackendError(message, 503))

    def _fresh(self) -> bool:
        at = self._state_at
        return at is not None and self._clock() - at <= self.state_timeout_s


def _log_crash(task: asyncio.Task[None]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        if task.exception() is not None:
            log.error("%s stopped", task.get_name(), exc_info=task.exception())
