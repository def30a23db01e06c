"""Workers the coordinator knows: what they serve, their KV layout, their last reported load.

Load between heartbeats is estimated: reserving blocks on a decode worker lowers its free
count, and a prefill job raises a prefill worker's queued prompt tokens, until the next
heartbeat replaces both with the worker's own figures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvtransfer.base import LayoutMismatchError, check_layouts
from protocol import messages as m

logger = logging.getLogger(__name__)


@dataclass
class Worker:
    info: m.Register
    last_seen: float
    free_blocks: int
    used_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    draining: bool = False

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def can_prefill(self) -> bool:
        return self.info.role in ("prefill", "both")

    @property
    def can_decode(self) -> bool:
        return self.info.role in ("decode", "both")


@dataclass
class WorkerRegistry:
    heartbeat_timeout_s: float = 5.0
    workers: dict[str, Worker] = field(default_factory=dict)

    def register(self, info: m.Register, now: float) -> None:
        """Add (or re-add) a worker; ``LayoutMismatchError`` if its KV blocks cannot be
        exchanged with the other workers of its model. Workers re-send it every second."""
        known = self.workers.get(info.worker_id)
        if known is not None and known.info == info:
            known.last_seen = now
            return
        for other in self.workers.values():
            if other.info.model != info.model or other.worker_id == info.worker_id:
                continue
            names = (f"{info.role} {info.worker_id}", f"{other.info.role} {other.worker_id}")
            check_layouts(info.layout, other.info.layout, names)
            if info.transfer_backend != other.info.transfer_backend:
                raise LayoutMismatchError(
                    f"{names[0]} moves KV over {info.transfer_backend!r} but {names[1]} over "
                    f"{other.info.transfer_backend!r}"
                )
        self.workers[info.worker_id] = Worker(info, now, free_blocks=info.num_blocks)

    def heartbeat(self, hb: m.Heartbeat, now: float) -> bool:
        worker = self.workers.get(hb.worker_id)
        if worker is None:
            return False
        worker.last_seen = now
        worker.free_blocks, worker.used_blocks = hb.free_blocks, hb.used_blocks
        worker.running, worker.waiting = hb.running, hb.waiting
        worker.queued_prompt_tokens = hb.queued_prompt_tokens
        if hb.draining and not worker.draining:
            logger.info("worker %s is draining: no new work goes to it", worker.worker_id)
        worker.draining = hb.draining
        return True

    def expire(self, now: float) -> list[Worker]:
        """Drop and return workers silent for longer than the heartbeat timeout."""
        dead = [w for w in self.workers.values() if now - w.last_seen > self.heartbeat_timeout_s]
        for w in dead:
            logger.warning("worker %s (%s) missed its heartbeats", w.worker_id, w.info.role)
            del self.workers[w.worker_id]
        return dead

    # ---- pairing ---------------------------------------------------------------------------
    def models(self) -> set[str]:
        return {w.info.model for w in self.workers.values()}

    def disaggregated(self, model: str) -> bool:
        """Split pools: some worker only prefills. Else every worker runs both phases."""
        return any(w.info.role == "prefill" for w in self._serving(model))

    def pick_decode(self, model: str, need_blocks: int) -> Worker | None:
        """The decode-capable worker with the most free blocks (fewest running on a tie)."""
        pool = [w for w in self._serving(model) if w.can_decode and w.free_blocks >= need_blocks]
        if not pool:
            return None
        best = max(pool, key=lambda w: (w.free_blocks, -w.running))
        best.free_blocks -= need_blocks
        return best

    def pick_prefill(self, model: str, prompt_tokens: int) -> Worker | None:
        """The prefill worker with the fewest queued prompt tokens."""
        pool = [w for w in self._serving(model) if w.info.role == "prefill"]
        if not pool:
            return None
        best = min(pool, key=lambda w: w.queued_prompt_tokens)
        best.queued_prompt_tokens += prompt_tokens
        return best

    def pick_colocated(self, model: str, tokens: int) -> Worker | None:
        pool = [w for w in self._serving(model) if w.info.role == "both"]
        if not pool:
            return None
        best = min(pool, key=lambda w: (w.queued_prompt_tokens + w.running, -w.free_blocks))
        best.queued_prompt_tokens += tokens
        return best

    def ready(self, model: str) -> bool:
        pool = self._serving(model)
        return any(w.can_prefill for w in pool) and any(w.can_decode for w in pool)

    def _serving(self, model: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.info.model == model and not w.draining]

    # ---- reporting -------------------------------------------------------------------------
    def cluster_state(self) -> m.ClusterState:
        models: dict[str, m.ServedModel] = {}
        for w in self.workers.values():
            name = w.info.model
            models.setdefault(
                name, m.ServedModel(name, w.info.model_root, w.info.max_model_len, self.ready(name))
            )
        workers = [
            m.WorkerStatus(
                w.info.role,
                w.worker_id,
                w.info.model,
                w.used_blocks,
                w.info.num_blocks,
                w.running,
                w.waiting,
            )
            for w in self.workers.values()
        ]
        return m.ClusterState(sorted(models.values(), key=lambda s: s.name), workers)
