"""The socket side of every role: an outbox of PUSH sockets and the recv → step → send loop
(and ``RateLimitedLog``, for what a role refuses from its peers).

Roles keep their logic in a socket-free class (``handle(msg)``, ``step()``); this module owns
the sockets around it, so tests can step the class alone. A worker's heartbeats go out from
a thread of their own (``runtime/liveness.py``), which the loop tells each time it comes round.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from pdserve.protocol.codec import Message
from pdserve.runtime.liveness import Liveness
from pdserve.runtime.sockets import make_socket, recv_from, send_msg

log = logging.getLogger(__name__)


class PushOutbox:
    """One connected PUSH socket per destination address, made on first use. Any thread may
    send: a lock hands the sockets from one to the next (a KV sender's thread reports a
    finished transfer while the worker's thread is inside a long step).

    Nothing is dropped when a receiver falls behind (no high-water mark, as vLLM's token
    sockets): a lost token leaves a gap its stream waits on forever, a lost ``Abort`` leaves
    blocks held. What waits here is bounded by the work admitted upstream (the gateway's
    in-flight limit times ``max_tokens``), not by this queue."""

    DROP_LOG_INTERVAL_S = 5.0

    def __init__(self, ctx: zmq.SyncContext, coordinator_address: str | None = None) -> None:
        self.ctx = ctx
        self.coordinator_address = coordinator_address
        self._socks: dict[str, zmq.SyncSocket] = {}
        self._lock = threading.Lock()
        self._dropped: dict[str, tuple[int, float]] = {}  # address -> (count, last logged)

    def send(self, address: str, msg: Message) -> None:
        with self._lock:
            sock = self._socks.get(address)
            if sock is None:
                sock = make_socket(
                    self.ctx,
                    zmq.PUSH,
                    address,
                    bind=False,
                    linger_ms=1000,
                    options={zmq.SNDHWM: 0},
                )
                self._socks[address] = sock
            try:
                send_msg(sock, msg, flags=zmq.NOBLOCK)
            except zmq.Again:  # no pipe to the peer at all; never a full one
                self._log_drop(address, msg)

    def _log_drop(self, address: str, msg: Message) -> None:
        """One line per address every few seconds, however many messages are lost."""
        count, logged = self._dropped.get(address, (0, float("-inf")))
        now = time.monotonic()
        if now - logged < self.DROP_LOG_INTERVAL_S:
            self._dropped[address] = (count + 1, logged)
            return
        log.warning(
            "dropped %s to %s (and %d other message(s) since the last report)",
            type(msg).__name__,
            address,
            count,
        )
        self._dropped[address] = (0, now)

    def to_coordinator(self, msg: Message) -> None:
        if self.coordinator_address is None:
            raise RuntimeError("this outbox has no coordinator address")
        self.send(self.coordinator_address, msg)

    def to_gateway(self, address: str, msg: Message) -> None:
        self.send(address, msg)

    def to_worker(self, worker_id: str, address: str, msg: Message) -> None:
        self.send(address, msg)

    def forget(self, address: str) -> None:
        with self._lock:
            sock = self._socks.pop(address, None)
            if sock is not None:
                sock.close(linger=0)

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()


class RateLimitedLog:
    """One line per key every ``interval_s``: a peer repeating a refused message each second
    must not flood the log."""

    def __init__(self, interval_s: float = 30.0, logger: logging.Logger = log) -> None:
        self.interval_s = interval_s
        self.logger = logger
        self._last: dict[str, float] = {}

    def error(self, key: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, float("-inf")) < self.interval_s:
            return
        if len(self._last) > 4096:
            self._last.clear()
        self._last[key] = now
        self.logger.error(fmt, *args)


class StopFlag:
    """Set once a role should stop: a plain attribute, no lock, so a signal handler may set
    it. A ``threading.Event`` set from the handler deadlocked when a second signal came in
    the middle of the first one's ``set`` (its lock held by the very frame the second handler
    interrupted): a worker hung forever after two SIGTERMs, outliving its cluster."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class Stop(Protocol):
    def is_set(self) -> bool: ...


def stop_on_signals() -> StopFlag:
    """A flag set by SIGTERM or SIGINT (main thread only)."""
    stop = StopFlag()

    def _handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


class Drain(Protocol):
    """A role that can finish its work before it exits."""

    def begin_drain(self) -> None: ...

    def in_flight(self) -> bool: ...


def serve(
    inbox: zmq.SyncSocket,
    handle: Callable[..., None],
    step: Callable[[], bool],
    periodic: Callable[[float], None],
    stop: Stop,
    period_s: float = 1.0,
    idle_wait_ms: int = 5,
    drain: Drain | None = None,
    drain_timeout_s: float = 30.0,
    liveness: Liveness | None = None,
    with_sender: bool = False,
    admit: Callable[[Message, str], bool] | None = None,
) -> None:
    """Until ``stop``: take every waiting message, run one step, and call ``periodic`` about
    every ``period_s``. Waits for input only when the last step had nothing to do.

    With ``drain``, a stop first turns new work away and keeps going until the work in
    flight is done (or ``drain_timeout_s`` passes). With ``liveness``, its thread runs while
    this does (started here, stopped and joined on the way out) and hears each time the loop
    comes round; ``periodic`` is then where the loop hands it a status. With ``with_sender``,
    ``handle(msg, sender)`` also gets the sender's CURVE identity (``recv_from``). With
    ``admit`` (a ``runtime.gate.RoleGate``'s), a message it refuses never reaches ``handle``."""

    def h(msg: Message, sender: str) -> None:
        if admit is not None and not admit(msg, sender):
            return
        if with_sender:
            handle(msg, sender)
        else:
            handle(msg)

    if liveness is not None:
        liveness.start()
    try:
        _loop(inbox, h, step, periodic, stop.is_set, period_s, idle_wait_ms, liveness)
        if drain is None:
            return
        drain.begin_drain()
        periodic(time.monotonic())  # tell the coordinator at once
        deadline = time.monotonic() + drain_timeout_s

        def done() -> bool:
            return not drain.in_flight() or time.monotonic() > deadline

        _loop(inbox, h, step, periodic, done, period_s, idle_wait_ms, liveness)
        if drain.in_flight():
            log.warning("drain timed out after %.0fs with work still in flight", drain_timeout_s)
    finally:
        if liveness is not None:
            liveness.close()


def _loop(
    inbox: zmq.SyncSocket,
    handle: Callable[[Message, str], None],
    step: Callable[[], bool],
    periodic: Callable[[float], None],
    until: Callable[[], bool],
    period_s: float,
    idle_wait_ms: int,
    liveness: Liveness | None,
) -> None:
    busy = False
    next_tick = 0.0
    while not until():
        timeout = 0 if busy else idle_wait_ms
        while inbox.poll(timeout, zmq.POLLIN):
            got = recv_from(inbox)
            if got is not None:
                sender, msg = got
                try:
                    handle(msg, sender)
                except Exception:  # one bad request never takes the worker down
                    log.exception("failed to handle %s", type(msg).__name__)
            timeout = 0
        try:
            busy = step()
        except Exception:
            log.exception("step failed")
            busy = False
        now = time.monotonic()
        if liveness is not None:
            liveness.came_round(now)
        if now >= next_tick:
            periodic(now)
            next_tick = now + period_s
