"""A worker's liveness, off its step loop: Register and Heartbeat go out from their own thread.

One step can take seconds (a long prefill chunk on a CPU); the coordinator must not read a
busy worker as a dead one. As vLLM's engine core keeps its I/O on threads, this thread sends
a keep-alive (the worker's ``Register``) every period whatever the loop is doing, and each
status (``Heartbeat``) the loop hands over. The loop thread alone touches engine state, so it
builds the status itself; this thread only sends it::

    loop thread    step ── publish(hb) ── step (5 s) ........................ ── publish(hb)
    this thread    Register, hb ── Register ── Register ── Register ── Register, hb

A keep-alive needs no fresh figures (the coordinator's ``Register`` handler only notes the
time), and a status goes out once: sending an old ``Heartbeat`` again would overwrite the
coordinator's estimates (blocks it reserved here since) with figures from before the step.

Only a loop that has not come round for ``stall_timeout_s`` (wedged, not busy) silences this
thread, with every thread's stack in the log, so the coordinator declares the worker dead as
before; if the loop comes back, keep-alives resume and the coordinator learns it again.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from pdserve.protocol.codec import Message

log = logging.getLogger(__name__)


class Liveness:
    """The keep-alive and status sender of one worker: ``start``, then from the loop thread
    ``came_round`` each iteration and ``publish`` a status now and then; ``close`` joins it."""

    def __init__(
        self,
        send: Callable[[Message], None],
        keepalive: Message,
        period_s: float = 1.0,
        stall_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        stack_file: TextIO | None = None,
    ) -> None:
        if period_s <= 0:
            raise ValueError(f"the heartbeat period must be positive, got {period_s}")
        if stall_timeout_s <= period_s:
            raise ValueError(
                f"the stall timeout ({stall_timeout_s}s) must be longer than the heartbeat "
                f"period ({period_s}s)"
            )
        self.send = send
        self.keepalive = keepalive
        self.period_s = period_s
        self.stall_timeout_s = stall_timeout_s
        self.stack_file = stack_file  # None: stderr
        self._clock = clock
        # Written by the loop thread, read by this one: each is a single attribute holding a
        # float or a frozen message, so under the GIL a read sees the old value or the new
        # one, never a mix, and no lock is needed.
        self._last_round = clock()
        self._status: Message | None = None
        # This thread's own.
        self._sent: Message | None = None
        self._next_keepalive = float("-inf")
        self.stalled = False  # silent: the loop has not come round within the stall limit
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)

    # ---- the loop thread ---------------------------------------------------------------------
    def came_round(self, now: float) -> None:
        """The loop finished one iteration (a step or an idle poll)."""
        self._last_round = now

    def publish(self, status: Message) -> None:
        """Hand over the latest status; it goes out at once (a drain is announced at once)."""
        self._status = status
        self._wake.set()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._last_round = self._clock()
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- this thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(max(0.0, self._next_keepalive - self._clock()))
            self._wake.clear()  # before reading the status: a later publish wakes us again
            stopping = self._stop.is_set()
            try:
                if stopping:  # what was handed over just before the stop (a drain) goes out
                    self._send_status()
                else:
                    self.tick(self._clock())
            except Exception:  # a failed send must not end liveness for good
                log.exception("heartbeat failed")
            if stopping:
                return

    def tick(self, now: float) -> None:
        """Send what is due at ``now``: a keep-alive each period, a status not yet sent."""
        if self._stalled_at(now):
            self._next_keepalive = now + self.period_s  # look again a period later
            return
        if now >= self._next_keepalive:
            self._next_keepalive = now + self.period_s
            self.send(self.keepalive)
        self._send_status()

    def _send_status(self) -> None:
        status = self._status  # one read: the loop may hand over a newer one at any time
        if status is not None and status is not self._sent:
            self.send(status)
            self._sent = status

    def _stalled_at(self, now: float) -> bool:
        quiet = now - self._last_round
        if quiet <= self.stall_timeout_s:
            if self.stalled:
                self.stalled = False
                self._next_keepalive = now  # at once, so the coordinator knows us again
                log.warning("the worker loop came round again: heartbeats resume")
            return False
        if not self.stalled:
            self.stalled = True
            log.error(
                "the worker loop has not come round for %.1fs (stall limit %.1fs): heartbeats "
                "stop, so the coordinator declares this worker dead; every thread's stack:",
                quiet,
                self.stall_timeout_s,
            )
            self._dump_stacks()
        return True

    def _dump_stacks(self) -> None:
        out = self.stack_file or sys.stderr
        try:
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
        except (AttributeError, OSError, ValueError) as exc:  # no file descriptor behind it
            log.error("could not write the stacks: %s", exc)
