"""What the coordinator does when a worker dies or does not answer (``Coordinator`` mixes it
in): work the worker had not started moves to another one, started work fails or, while its
tokens stream, is handed back to the gateway to resume; a reservation or a prefill job past
its timeout goes to another worker (the silent one is told to drop it), else fails."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdserve.coordinator.routes import Key, Route, RouteTable
from pdserve.protocol import messages as m

if TYPE_CHECKING:
    from pdserve.coordinator.coordinator import CoordinatorOutbox
    from pdserve.coordinator.registry import Worker, WorkerRegistry

logger = logging.getLogger(__name__)

SILENT_HOLD_S = 30.0  # a worker that let a reservation time out gets no new one this long


class Recovery:
    outbox: CoordinatorOutbox
    registry: WorkerRegistry
    routes: RouteTable
    reserve_timeout_s: float
    prefill_timeout_s: float
    queue_timeout_s: float
    silent: dict[str, float]
    _now: float

    if TYPE_CHECKING:  # provided by Coordinator or another of its mixins

        def _fail(
            self, key: Key, status: int, message: str, req: m.Generate | None = None
        ) -> None: ...
        def _send(self, worker_id: str, msg: m.Message) -> None: ...
        def _reserve(
            self, req: m.Generate, choice: int, tried: set[str] | None = None, why: str = ""
        ) -> bool: ...
        def _pick_prefill(self, req: m.Generate, tried: set[str]) -> Worker | None: ...
        def _place_queued(self) -> None: ...

    def tick(self, now: float) -> None:
        self._now = now
        for worker in self.registry.expire(now):
            self.outbox.forget_worker(worker.worker_id)
            self.silent.pop(worker.worker_id, None)
            self._reroute_from(worker.worker_id)
        self._expire_waits(now)
        self._place_queued()

    def _reroute_from(self, worker_id: str) -> None:
        for key, route in list(self.routes.items()):
            if key in self.routes and worker_id in (route.decode, route.prefill):
                self._worker_lost(key, route, worker_id)

    def _worker_lost(self, key: Key, route: Route, worker_id: str) -> None:
        """Work the dead worker had not started goes elsewhere; started work fails (503)."""
        req = route.request
        why = f"worker {worker_id} stopped responding"
        if route.state == "reserving" and route.decode == worker_id:
            self.routes.pop(key)
            self._reserve(req, route.choice, route.tried | {worker_id}, why)
        elif route.state == "prefilling" and route.prefill == worker_id:
            self._move_prefill(key, route, why)
        elif route.state in ("decoding", "local"):
            # tokens are streaming: the gateway may resume this choice on another worker
            self.routes.pop(key)
            other = {route.decode, route.prefill} - {"", worker_id}
            for wid in other:
                self._send(wid, m.Abort(key[0], "worker lost", key[1]))
            self.outbox.to_gateway(
                req.stream_address,
                m.RequestError(
                    key[0],
                    503,
                    f"worker {worker_id} stopped responding",
                    key[1],
                    retryable=True,
                ),
            )
        else:
            self._fail(key, 503, f"worker {worker_id} stopped responding")

    def _move_prefill(self, key: Key, route: Route, why: str) -> None:
        """The decode reservation still stands: prefill again on another worker."""
        route.tried.add(route.prefill)
        prefill = self._pick_prefill(route.request, route.tried)
        if prefill is None or route.job is None:
            self._fail(key, 503, f"{why}; no other prefill worker can take it")
            return
        logger.warning(
            "request %s#%d: %s; prefill moves to %s", key[0], key[1], why, prefill.worker_id
        )
        route.prefill, route.since = prefill.worker_id, self._now
        self._send(prefill.worker_id, route.job)

    def _expire_waits(self, now: float) -> None:
        """Reservations and prefill jobs past their timeout go to another worker, or fail."""
        for key, route in list(self.routes.items()):
            if self.routes.get(key) is not route:
                continue  # ended or placed again while this loop ran
            waited = now - route.since
            if route.state == "queued" and waited > self.queue_timeout_s:
                why = f"no decode worker had free KV blocks for {waited:.0f} s"
                self._fail(key, 503, why, route.request)
            elif route.state == "reserving" and waited > self.reserve_timeout_s:
                wid = route.decode
                why = f"decode worker {wid} did not answer a reservation in {waited:.1f} s"
                logger.warning("request %s#%d: %s", key[0], key[1], why)
                self.silent[wid] = now
                self._send(wid, m.Abort(key[0], "reservation timed out", key[1]))
                self.routes.pop(key)
                self._reserve(route.request, route.choice, route.tried | {wid}, why)
            elif route.state == "prefilling" and waited > self.prefill_timeout_s:
                wid = route.prefill
                why = f"prefill worker {wid} did not finish a prefill job in {waited:.1f} s"
                self._send(wid, m.Abort(key[0], "prefill timed out", key[1]))
                self._move_prefill(key, route, why)

    def _silent(self) -> set[str]:
        now = self._now
        return {wid for wid, at in self.silent.items() if now - at < SILENT_HOLD_S}
