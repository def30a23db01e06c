"""Holding decode blocks for a request's choices (``Coordinator`` mixes it in): the decode
worker with the most room and cache (``Placement``) gets a ``Reserve``; with none free now, the
choice queues (first come, first served, bounded by ``max_queued``) until heartbeats and ticks
show blocks back."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdserve.coordinator.routes import Key, Route, RouteTable
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import fork_blocks

if TYPE_CHECKING:
    from pdserve.coordinator.placement import Placement
    from pdserve.coordinator.registry import WorkerRegistry

logger = logging.getLogger(__name__)


class DecodeReservation:
    registry: WorkerRegistry
    placement: Placement
    routes: RouteTable
    max_queued: int
    _now: float

    if TYPE_CHECKING:  # provided by Coordinator or another of its mixins

        def _send(self, worker_id: str, msg: m.Message) -> None: ...
        def _fail(
            self, key: Key, status: int, message: str, req: m.Generate | None = None
        ) -> None: ...
        def _block_size(self, model: str) -> int: ...
        def _silent(self) -> set[str]: ...

    def _blocks_for(self, req: m.Generate, choices: int) -> int:
        """Decode blocks ``choices`` forked choices start with: the prompt's and token 0's,
        and one more each past the first (engine/fork.py ``fork_blocks_needed``)."""
        return fork_blocks(len(req.prompt_token_ids), choices, self._block_size(req.model))

    def _reserve(
        self, req: m.Generate, choice: int, tried: set[str] | None = None, why: str = ""
    ) -> bool:
        """Ask the decode worker with the most room (none of ``tried``, none silent) to hold
        blocks for this choice (choice 0: for every choice of the request, which go as one);
        ``why`` the last one did not."""
        choices = req.n if choice == 0 else 1
        need = self._blocks_for(req, choices)
        tried = tried or set()
        worker = self.placement.pick_decode(
            req.model, need, tried | self._silent(), req.prompt_token_ids
        )
        if worker is None:
            if self._can_queue(req.model):
                # the pool is full for now: wait for blocks to come back, oldest first
                route = Route(req, choice, "queued", since=self._now, need=need)
                route.choices = choices
                self.routes.add(route)
                logger.info("request %s#%d: queued (%s)", req.request_id, choice, why or "full")
                return True
            key = (req.request_id, choice)
            message = "no decode worker has free KV blocks for this prompt"
            self._fail(key, 503, f"{why}; {message}" if why else message, req)
            return False
        route = Route(req, choice, "reserving", decode=worker.worker_id, since=self._now)
        route.need, route.tried, route.choices = need, tried, choices
        self.routes.add(route)
        self._send_reserve(route)
        return True

    def _send_reserve(self, route: Route) -> None:
        req = route.request
        msg = m.Reserve(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            req.n,
            req.stream_address,
            route.choice,
            route.choices,
        )
        self._send(route.decode, msg)

    def _can_queue(self, model: str) -> bool:
        """A choice may wait for blocks while some decode worker of its model answers and the
        queue has room; else it fails at once (503, retryable)."""
        queued = sum(1 for r in self.routes.values() if r.state == "queued")
        return queued < self.max_queued and self.registry.has_decoder(model, self._silent())

    def _place_queued(self) -> None:
        """Reserve for waiting choices, oldest first, while decode blocks allow."""
        silent = self._silent()
        for route in [r for r in self.routes.values() if r.state == "queued"]:
            req = route.request
            worker = self.placement.pick_decode(req.model, route.need, silent, req.prompt_token_ids)
            if worker is None:
                return  # first come, first served: no later, smaller one jumps the queue
            route.state, route.decode, route.since = "reserving", worker.worker_id, self._now
            self._send_reserve(route)
