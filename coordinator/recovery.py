"""What the coordinator does when a worker dies or does not answer: work the worker had not
started moves to another one, started work fails or, while its tokens stream, is handed back to
the gateway to resume; a reservation or a prefill job past its timeout goes to another worker
(the silent one is told to drop it); a prefill job with no other prefill worker left is
recomputed by the decode worker holding its blocks; else it fails."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.coordinator.dispatch import LocalPrefill, Reservations
from pdserve.coordinator.peers import TransferPeers
from pdserve.coordinator.placement import Placement
from pdserve.coordinator.routes import Route, RouteState, Shared
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    """How long each wait may last, in seconds."""

    reserve_s: float = 5.0  # a decode worker's answer to ``Reserve``
    prefill_s: float = 120.0  # a prefill job's ``TransferDone``
    queue_s: float = 60.0  # a choice waiting for free decode blocks

    def __post_init__(self) -> None:
        timeouts = (
            ("reserve", self.reserve_s),
            ("prefill", self.prefill_s),
            ("queue", self.queue_s),
        )
        for name, value in timeouts:
            if not value > 0:
                raise ValueError(f"the {name} timeout must be > 0 s, got {value}")


class Recovery:
    """Owns the bounds on every wait and the routes of a worker that is gone: dead (no
    heartbeat), restarted, or silent past a timeout (marked in ``Shared.silent``)."""

    def __init__(
        self,
        shared: Shared,
        placement: Placement,
        reservations: Reservations,
        timeouts: Timeouts,
        peers: TransferPeers,
        local: LocalPrefill,
    ) -> None:
        self.shared = shared
        self.local = local
        self.peers = peers
        self.placement = placement
        self.reservations = reservations
        self.timeouts = timeouts

    def expire_workers(self, now: float) -> None:
        """Workers past their heartbeat timeout are forgotten; their routes go elsewhere."""
        shared = self.shared
        for worker in shared.registry.expire(now):
            shared.outbox.forget_worker(worker.worker_id)
            shared.silent.heard(worker.worker_id)
            self.peers.left(worker.info)
            self.reroute_from(worker.worker_id, now)

    def reroute_from(self, worker_id: str, now: float) -> None:
        """Every route on ``worker_id`` (dead or restarted) moves, is handed back or fails."""
        routes = self.shared.routes
        for key, route in list(routes.items()):
            if key in routes and worker_id in (route.decode, route.prefill):
                self._worker_lost(key, route, worker_id, now)

    def _worker_lost(self, key: ChoiceKey, route: Route, worker_id: str, now: float) -> None:
        """Work the dead worker had not started goes elsewhere; started work fails (503)."""
        shared = self.shared
        why = f"worker {worker_id} stopped responding"
        if route.state is RouteState.RESERVING and route.decode == worker_id:
            shared.routes.pop(key)
            tried = route.tried | {worker_id}
            self.reservations.reserve(route.request, route.choice, now, tried, why)
        elif route.state is RouteState.PREFILLING and route.prefill == worker_id:
            self._move_prefill(key, route, why, now)
        elif route.state in (RouteState.DECODING, RouteState.LOCAL):
            # tokens are streaming: the gateway may resume this choice on another worker
            shared.routes.pop(key)
            for wid in route.workers() - {worker_id}:
                abort = m.Abort(request_id=key.request_id, reason="worker lost", choice=key.choice)
                shared.send(wid, abort)
            error = m.RequestError(
                request_id=key.request_id,
                status=503,
                message=why,
                choice=key.choice,
                retryable=True,
            )
            shared.outbox.to_gateway(route.request.stream_address, error)
        else:
            shared.fail(key, 503, why)

    def _move_prefill(self, key: ChoiceKey, route: Route, why: str, now: float) -> None:
        """The decode reservation still stands: prefill again on another worker."""
        shared = self.shared
        req = route.request
        avoid = route.tried | {route.prefill} | shared.avoid(now)
        prefill = self.placement.pick_prefill(req.model, req.prompt_token_ids, avoid)
        if prefill is None or route.job is None:
            self.local.instead_of_transfer(route, why, now)
            return
        logger.warning("request %s: %s; prefill moves to %s", key, why, prefill.worker_id)
        route.prefill_moves_to(prefill.worker_id, now)
        shared.send(prefill.worker_id, route.job)

    def expire_waits(self, now: float) -> None:
        """Reservations and prefill jobs past their timeout go to another worker, or fail."""
        shared, timeouts = self.shared, self.timeouts
        for key, route in list(shared.routes.items()):
            if shared.routes.get(key) is not route:
                continue  # ended or placed again while this loop ran
            waited = now - route.since
            if route.state is RouteState.QUEUED and waited > timeouts.queue_s:
                why = f"no decode worker had free KV blocks for {waited:.0f} s"
                shared.fail(key, 503, why, route.request)
            elif route.state is RouteState.RESERVING and waited > timeouts.reserve_s:
                wid = route.decode
                why = f"decode worker {wid} did not answer a reservation in {waited:.1f} s"
                logger.warning("request %s: %s", key, why)
                shared.silent.mark(wid, now)
                abort = m.Abort(
                    request_id=key.request_id, reason="reservation timed out", choice=key.choice
                )
                shared.send(wid, abort)
                shared.routes.pop(key)
                tried = route.tried | {wid}
                self.reservations.reserve(route.request, route.choice, now, tried, why)
            elif route.state is RouteState.PREFILLING and waited > timeouts.prefill_s:
                wid = route.prefill
                why = f"prefill worker {wid} did not finish a prefill job in {waited:.1f} s"
                abort = m.Abort(
                    request_id=key.request_id, reason="prefill timed out", choice=key.choice
                )
                shared.send(wid, abort)
                self._move_prefill(key, route, why, now)
