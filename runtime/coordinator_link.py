"""Whether a worker is heard by its coordinator: a connection the coordinator accepted.

A worker's messages to the coordinator go over PUSH sockets, which never answer, and the
coordinator sends a worker nothing until it has work. So a worker learns that it is heard the
way ZeroMQ does: a PUSH socket that never sends is dialled to the coordinator's inbox, and a
ZMQ socket monitor reports its handshakes, on a thread of its own::

    connected ── handshake ──▶ up  (the coordinator's ZAP handler admitted this worker's key)
                          └──▶ refused (a key the cluster does not list, or another cluster's)
    up ── disconnected ──▶ down (the coordinator went away; ZeroMQ dials again by itself)

With CURVE (every cluster but ``--insecure`` ones) a handshake completes only once the
coordinator's process admitted the key the worker's Register goes out with; what it makes of a
Register's contents (a refused KV layout) is in the coordinator's log, not seen here.
"""

from __future__ import annotations

import logging
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.runtime.security import security_of

log = logging.getLogger(__name__)

EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
)
POLL_MS = 200  # how often the thread looks at its stop flag
RECONNECT_MAX_MS = 5000  # redial at 0.1 s, doubling up to this (ZeroMQ's default: no backoff)


class CoordinatorLink:
    """The watching connection and its thread: ``start``, read ``problem``, ``close`` (before
    the context is terminated: the socket is this thread's)."""

    def __init__(self, ctx: zmq.SyncContext, address: str) -> None:
        self.ctx = ctx
        self.address = address
        # written by this thread alone, read by probes: each a single attribute
        self.up = False
        self.problem: str | None = f"no connection to the coordinator at {address} yet"
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="coordinator-link", daemon=True)

    def start(self) -> CoordinatorLink:
        self._thread.start()
        self._started.wait(5.0)  # the monitor is on before this returns
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)  # a refused key backs off
        security = security_of(self.ctx)
        if security is not None:
            security.secure(sock, bind=False)
        # the monitor before connect: the first handshake can beat anything done after it
        monitor = sock.get_monitor_socket(EVENTS)
        try:
            sock.connect(self.address)
            self._started.set()
            while not self._stop.is_set():
                if monitor.poll(POLL_MS):
                    self.on_event(recv_monitor_message(monitor)["event"])
        except zmq.ZMQError as e:  # a context terminated under it, or a bad address
            self.up, self.problem = False, f"cannot watch the coordinator at {self.address}: {e}"
        finally:
            self._started.set()
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def on_event(self, event: int) -> None:
        """One monitor event: the link's state after it."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if not self.up:
                log.info("the coordinator at %s admitted this worker's key", self.address)
            self.up, self.problem = True, None
        elif event == zmq.EVENT_DISCONNECTED:
            if self.up:  # (after a refused handshake the refusal stays the reason)
                log.warning("lost the connection to the coordinator at %s", self.address)
                self.problem = f"disconnected from the coordinator at {self.address}"
            self.up = False
        elif event & EVENTS:  # a failed handshake: wrong keys, or not a pdserve coordinator
            refused = f"the coordinator at {self.address} refused the handshake (keys?)"
            if self.problem != refused:
                log.error(
                    "the coordinator at %s refused this worker's connection: check --keys "
                    "(the same cluster's keygen, a key listed in its authorized/)",
                    self.address,
                )
            self.up, self.problem = False, refused
