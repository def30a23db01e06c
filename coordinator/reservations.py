"""Holding decode blocks for a request's choices: the decode worker with the most room and
cache (``Placement``) gets a ``Reserve``; with none free now, the choice queues (first come,
first served, bounded by the ``AdmissionPolicy``) until heartbeats and ticks show blocks back.
A refusal asks another decode worker."""

from __future__ import annotations

import logging

from pdserve.coordinator.admission import AdmissionPolicy
from pdserve.coordinator.placement import Placement
from pdserve.coordinator.routes import Route, RouteState
from pdserve.coordinator.shared import Shared
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import fork_blocks
from pdserve.protocol.keys import ChoiceKey

logger = logging.getLogger(__name__)


class Reservations:
    """Owns the routes from ``queued`` to the answer of their decode worker (``reserving``):
    the queue of choices waiting for blocks, the ``Reserve`` sent, the ``Reserved`` taken (its
    free count into the worker's estimate), and a reservation asked again elsewhere when one
    is refused, times out or its worker dies."""

    def __init__(self, shared: Shared, placement: Placement, admission: AdmissionPolicy) -> None:
        self.shared = shared
        self.placement = placement
        self.admission = admission

    def blocks_for(self, req: m.Generate, choices: int) -> int:
        """Decode blocks ``choices`` forked choices start with (``protocol.blocks``)."""
        block_size = self.shared.registry.block_size(req.model)
        return fork_blocks(len(req.prompt_token_ids), choices, block_size)

    def reserve(
        self, req: m.Generate, choice: int, tried: set[str] | None = None, why: str = ""
    ) -> bool:
        """Ask the decode worker with the most room (none of ``tried``, none silent) to hold
        blocks for this choice (choice 0: for every choice of the request, which go as one);
        ``why`` the last one did not. False: the request failed."""
        shared = self.shared
        choices = req.n if choice == 0 else 1
        need = self.blocks_for(req, choices)
        tried = tried or set()
        avoid = tried | shared.avoid()
        worker = self.placement.pick_decode(req.model, need, avoid, req.prompt_token_ids)
        if worker is None:
            return self._queue(req, choice, choices, need, why)
        route = Route(
            req,
            choice,
            RouteState.RESERVING,
            decode=worker.worker_id,
            since=shared.now,
            need=need,
            tried=tried,
            choices=choices,
        )
        shared.routes.add(route)
        self._send_reserve(route)
        return True

    def _queue(self, req: m.Generate, choice: int, choices: int, need: int, why: str) -> bool:
        """The pool is full for now: wait for blocks to come back, oldest first; or fail."""
        shared = self.shared
        queued = len(shared.routes.in_state(RouteState.QUEUED))
        decoder = shared.registry.has_decoder(req.model, shared.avoid())
        if self.admission.can_queue(queued, decoder):
            route = Route(req, choice, RouteState.QUEUED, since=shared.now, need=need)
            route.choices = choices
            shared.routes.add(route)
            logger.info("request %s#%d: queued (%s)", req.request_id, choice, why or "full")
            return True
        message = "no decode worker has free KV blocks for this prompt"
        key = ChoiceKey(req.request_id, choice)
        shared.fail(key, 503, f"{why}; {message}" if why else message, req)
        return False

    def place_queued(self) -> None:
        """Reserve for waiting choices, oldest first, while decode blocks allow."""
        shared = self.shared
        avoid = shared.avoid()
        for route in shared.routes.in_state(RouteState.QUEUED):
            req = route.request
            worker = self.placement.pick_decode(req.model, route.need, avoid, req.prompt_token_ids)
            if worker is None:
                return  # first come, first served: no later, smaller one jumps the queue
            route.state, route.decode, route.since = (
                RouteState.RESERVING,
                worker.worker_id,
                shared.now,
            )
            self._send_reserve(route)

    def answered(self, msg: m.Reserved) -> Route | None:
        """A decode worker's answer: the route that now holds its blocks, to prefill; None
        when there is nothing more to do (a late answer given back, a refusal asked
        elsewhere)."""
        shared = self.shared
        key = ChoiceKey(msg.request_id, msg.choice)
        route = shared.routes.get(key)
        shared.silent.heard(msg.worker_id)
        in_flight = self.reserving_on(msg.worker_id, but=key)
        shared.registry.free_blocks_answered(msg.worker_id, msg.free_blocks, in_flight)
        if (
            route is None
            or route.state is not RouteState.RESERVING
            or route.decode != msg.worker_id
        ):
            # aborted meanwhile, or a late answer after the choice moved: give the blocks back
            if msg.error is None:
                abort = m.Abort(
                    request_id=msg.request_id, reason="no longer wanted", choice=msg.choice
                )
                shared.send(msg.worker_id, abort)
            return None
        if msg.error is not None:
            why = f"decode worker {msg.worker_id} could not reserve: {msg.error}"
            logger.info("request %s: %s", key, why)
            shared.routes.pop(key)
            self.reserve(route.request, route.choice, route.tried | {msg.worker_id}, why)
            return None
        return route

    def reserving_on(self, worker_id: str, but: ChoiceKey) -> int:
        """Blocks asked of ``worker_id`` by reservations it has not answered yet, but ``but``."""
        return sum(
            r.need
            for r in self.shared.routes.in_state(RouteState.RESERVING)
            if r.decode == worker_id and r.key != but
        )

    def _send_reserve(self, route: Route) -> None:
        req = route.request
        msg = m.Reserve(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            n=req.n,
            stream_address=req.stream_address,
            choice=route.choice,
            choices=route.choices,
        )
        self.shared.send(route.decode, msg)
