"""What the coordinator's parts share, handed to each part when the coordinator builds it."""

from __future__ import annotations

import logging
from typing import Protocol

from pdserve.coordinator.registry import WorkerRegistry
from pdserve.coordinator.routes import RouteTable
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey

logger = logging.getLogger(__name__)

SILENT_HOLD_S = 30.0  # a worker that let a reservation time out gets no new one this long


class CoordinatorOutbox(Protocol):
    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None: ...

    def to_gateway(self, address: str, msg: m.Message) -> None: ...

    def forget_worker(self, worker_id: str) -> None: ...


class SilentWorkers:
    """Owns the workers that let a reservation or a prefill job time out, and when: they are
    passed over for new work until they answer again, register again, die, or
    ``hold_s`` passes."""

    def __init__(self, hold_s: float = SILENT_HOLD_S) -> None:
        self.hold_s = hold_s
        self._since: dict[str, float] = {}

    def mark(self, worker_id: str, now: float) -> None:
        self._since[worker_id] = now

    def heard(self, worker_id: str) -> None:
        """The worker answered (or is a new process): nothing holds it back."""
        self._since.pop(worker_id, None)

    def at(self, now: float) -> set[str]:
        """The workers still silent at ``now``."""
        return {wid for wid, at in self._since.items() if now - at < self.hold_s}


class Shared:
    """The state every part of the coordinator reads: the workers (``registry``), the routes,
    the silent workers and the clock (``now``: the time of the message or tick being handled,
    set by the coordinator); and the way out (``outbox``), with the sends every part makes:
    to a worker, an error to a gateway, the end of a request on every worker it touched."""

    def __init__(self, outbox: CoordinatorOutbox, registry: WorkerRegistry) -> None:
        self.outbox = outbox
        self.registry = registry
        self.routes = RouteTable()
        self.silent = SilentWorkers()
        self.now = 0.0

    def avoid(self) -> set[str]:
        """Workers not to give new work now: the silent ones."""
        return self.silent.at(self.now)

    def send(self, worker_id: str, msg: m.Message) -> None:
        worker = self.registry.workers.get(worker_id)
        if worker is not None:
            self.outbox.to_worker(worker_id, worker.info.control_address, msg)

    def error_to(self, req: m.Generate, status: int, message: str) -> None:
        logger.info("request %s: %d %s", req.request_id, status, message)
        error = m.RequestError(request_id=req.request_id, status=status, message=message)
        self.outbox.to_gateway(req.stream_address, error)

    def drop(self, request_id: str, choice: int | None, reason: str) -> set[str]:
        """Abort the routes of a request (one choice, or all) on every worker they touch;
        the gateways that were waiting on them."""
        gateways = set()
        for key in self.routes.keys_of(request_id, choice):
            route = self.routes.pop(key)
            gateways.add(route.request.stream_address)
            for worker_id in route.workers():
                abort = m.Abort(request_id=request_id, reason=reason, choice=route.choice)
                self.send(worker_id, abort)
        return gateways

    def fail(
        self, key: ChoiceKey, status: int, message: str, req: m.Generate | None = None
    ) -> None:
        """End a request on every worker its choices touched and tell its gateway (``req``:
        the request, when ``key`` has no route)."""
        route = self.routes.get(key)
        request = req or (route.request if route else None)
        if request is None:
            return
        self.drop(key.request_id, None, message)
        self.error_to(request, status, message)
