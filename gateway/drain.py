"""Graceful drain: the gateway's answer to SIGTERM (and Ctrl-C)::

    signal ─▶ draining: new /v1/* requests get 503 + Retry-After, /health 503 "draining";
              running requests go on, the listening socket stays open
           ─▶ in flight = 0  ───────────────────────────────────────────────┐
           ─▶ or --drain-timeout passed: running generations end with an     ├▶ uvicorn shutdown
              error (an SSE error event, then [DONE]) and are aborted at the │   ─▶ exit 0
              backend; EXPIRE_GRACE_S for them to leave  ────────────────────┘

Each further signal skips the wait in progress (the last one: uvicorn's force exit).

uvicorn's own handler shuts down at once and then re-raises the signal, so the process dies
of it (exit 143); this one never re-raises: a drained gateway exits 0.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from pdserve.gateway.admission import AdmissionState
from pdserve.gateway.errors import OpenAIError

log = logging.getLogger(__name__)

EXPIRE_GRACE_S = 2.0  # after expiring the stragglers, how long their responses may take
SHUTDOWN_GRACE_S = 5  # uvicorn's wait for connections once it shuts down


def shutdown_error() -> OpenAIError:
    return OpenAIError(503, "The server shut down before the request finished.")


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        admission: AdmissionState,
        drain_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config)
        self.admission = admission
        self.drain_timeout_s = drain_timeout_s
        self._clock = clock
        self._deadline: float | None = None  # set once the drain began
        self._expired_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        elif self._deadline is None and self.drain_timeout_s > 0 and self.started:
            self.begin_drain(signal.Signals(sig).name)
        elif self._deadline is not None and self._expired_at is None:
            self._deadline = self._clock()  # stop waiting: expire the rest at the next tick
        else:
            self.should_exit = True

    def begin_drain(self, why: str = "asked") -> None:
        self.admission.draining = True
        self._deadline = self._clock() + self.drain_timeout_s
        log.info(
            "%s: draining %d request(s) in flight, for at most %g s",
            why,
            self.admission.in_flight,
            self.drain_timeout_s,
        )

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is not None and not self.should_exit:
            self._drain_step(self._deadline)
        return await super().on_tick(counter)

    def _drain_step(self, deadline: float) -> None:
        now = self._clock()
        if self.admission.in_flight == 0:
            log.info("drained: no request in flight; shutting down")
            self.should_exit = True
        elif self._expired_at is None and now >= deadline:
            ended = self.admission.expire_all(shutdown_error())
            log.warning(
                "drain timeout: ending %d generation(s) of %d request(s) in flight",
                ended,
                self.admission.in_flight,
            )
            self._expired_at = now
        elif self._expired_at is not None and now - self._expired_at >= EXPIRE_GRACE_S:
            log.warning("%d request(s) still in flight; shutting down", self.admission.in_flight)
            self.should_exit = True
