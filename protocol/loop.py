"""The socket side of every role: an outbox of PUSH sockets and the recv → step → send loop.

Roles keep their logic in a socket-free class (``handle(msg)``, ``step()``); this module owns
the sockets around it, so tests can step the class alone.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

import zmq

from protocol.codec import Message
from protocol.sockets import make_socket, recv_msg, send_msg

log = logging.getLogger(__name__)


class PushOutbox:
    """One connected PUSH socket per destination address, made on first use."""

    def __init__(self, ctx: zmq.Context, coordinator_address: str | None = None) -> None:
        self.ctx = ctx
        self.coordinator_address = coordinator_address
        self._socks: dict[str, zmq.Socket] = {}

    def send(self, address: str, msg: Message) -> None:
        sock = self._socks.get(address)
        if sock is None:
            sock = make_socket(self.ctx, zmq.PUSH, address, bind=False, linger_ms=1000)
            self._socks[address] = sock
        try:
            send_msg(sock, msg, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropped %s to %s: its queue is full", type(msg).__name__, address)

    def to_coordinator(self, msg: Message) -> None:
        if self.coordinator_address is None:
            raise RuntimeError("this outbox has no coordinator address")
        self.send(self.coordinator_address, msg)

    def to_gateway(self, address: str, msg: Message) -> None:
        self.send(address, msg)

    def to_worker(self, worker_id: str, address: str, msg: Message) -> None:
        self.send(address, msg)

    def forget(self, address: str) -> None:
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (main thread only)."""
    stop = threading.Event()

    def _handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


def serve(
    inbox: zmq.Socket,
    handle: Callable[[Message], None],
    step: Callable[[], bool],
    periodic: Callable[[float], None],
    stop: threading.Event,
    period_s: float = 1.0,
    idle_wait_ms: int = 5,
) -> None:
    """Until ``stop``: take every waiting message, run one step, and call ``periodic`` about
    every ``period_s``. Waits for input only when the last step had nothing to do."""
    busy = False
    next_tick = 0.0
    while not stop.is_set():
        timeout = 0 if busy else idle_wait_ms
        while inbox.poll(timeout, zmq.POLLIN):
            msg = recv_msg(inbox)
            if msg is not None:
                try:
                    handle(msg)
                except Exception:  # one bad request never takes the worker down
                    log.exception("failed to handle %s", type(msg).__name__)
            timeout = 0
        try:
            busy = step()
        except Exception:
            log.exception("step failed")
            busy = False
        now = time.monotonic()
        if now >= next_tick:
            periodic(now)
            next_tick = now + period_s
