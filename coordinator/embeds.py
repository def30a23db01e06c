"""Embedding requests in flight: each goes to the least busy embed worker of its model, and
the coordinator remembers it (``EmbedRouter``) until the worker says it is over, so a worker
that dies or leaves fails its requests at once rather than at the gateway's timeout.

    Embed ─▶ route ─▶ in_flight[id] ─Finished / RequestError─▶ · (the result went to the
                         │                                       gateway straight)
                         └─ its worker gone ─▶ 503 to the gateway ─▶ ·
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.coordinator.registry import WorkerRegistry
from pdserve.coordinator.routes import CoordinatorOutbox
from pdserve.protocol import messages as m

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class InFlight:
    worker_id: str
    stream_address: str
    tokens: int


class EmbedRouter:
    """Owns ``in_flight``: which embed worker has each embedding request, for which gateway."""

    def __init__(self, outbox: CoordinatorOutbox, registry: WorkerRegistry) -> None:
        self.outbox = outbox
        self.registry = registry
        self.in_flight: dict[str, InFlight] = {}

    def route(self, msg: m.Embed, known: bool) -> None:
        """Send ``msg`` to the embed worker of its model with the fewest tokens in flight;
        ``known``: some worker serves the model (else 404), of another kind if none embeds."""
        workers = self.registry.embeds(msg.model)
        if not workers:
            if known:
                status, why = (
                    400,
                    f"model `{msg.model}` is a generative model: it serves no embeddings",
                )
            else:
                status, why = 404, f"the model `{msg.model}` does not exist"
            self._error(msg.request_id, msg.stream_address, status, why)
            return
        load = {w.worker_id: 0 for w in workers}
        for job in self.in_flight.values():
            if job.worker_id in load:
                load[job.worker_id] += job.tokens
        worker = min(workers, key=lambda w: load[w.worker_id])
        tokens = sum(len(ids) for ids in msg.inputs)
        self.in_flight[msg.request_id] = InFlight(worker.worker_id, msg.stream_address, tokens)
        self.outbox.to_worker(worker.worker_id, worker.info.control_address, msg)

    def ended(self, request_id: str) -> bool:
        """The worker is done with it (answered, or failed it to the gateway itself)."""
        return self.in_flight.pop(request_id, None) is not None

    def abort(self, msg: m.Abort) -> bool:
        """The gateway gave up on one (its timeout): its worker drops it if it still waits."""
        job = self.in_flight.pop(msg.request_id, None)
        if job is None:
            return False
        worker = self.registry.workers.get(job.worker_id)
        if worker is not None:
            self.outbox.to_worker(job.worker_id, worker.info.control_address, msg)
        return True

    def lost(self) -> None:
        """Requests whose worker is no longer registered fail (503, retryable by the client)."""
        live = self.registry.workers
        for request_id, job in list(self.in_flight.items()):
            if job.worker_id not in live:
                del self.in_flight[request_id]
                why = f"embed worker {job.worker_id} stopped responding"
                self._error(request_id, job.stream_address, 503, why)

    def _error(self, request_id: str, address: str, status: int, message: str) -> None:
        logger.info("embedding request %s: %d %s", request_id, status, message)
        error = m.RequestError(request_id=request_id, status=status, message=message)
        self.outbox.to_gateway(address, error)
