"""Workers the coordinator knows: what they serve, their KV layout, their last reported load.

Load between heartbeats is estimated: reserving blocks on a decode worker lowers its free
count, and a prefill job raises a prefill worker's queued prompt tokens, until the next
heartbeat replaces both with the worker's own figures.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Collection
from dataclasses import dataclass, field

from pdserve.coordinator.kv_index import KVIndex
from pdserve.coordinator.trust import (
    RateLimitedLog,
    heartbeat_problem,
    kv_events_problem,
    register_problem,
)
from pdserve.kvtransfer.base import LayoutMismatchError, check_layouts
from pdserve.protocol import messages as m

logger = logging.getLogger(__name__)

# what only the worker itself may say: checked against the key that registered its id
WORKER_MESSAGES = (m.Heartbeat, m.Reserved, m.Finished, m.KVEvents)


@dataclass
class Worker:
    """One registered worker: what it registered, and its load as last reported (or
    estimated since)."""

    info: m.Register
    last_seen: float
    free_blocks: int
    used_blocks: int = 0
    running: int = 0
    waiting: int = 0
    queued_prompt_tokens: int = 0
    draining: bool = False
    counters: m.WorkerCounters = field(default_factory=m.WorkerCounters)

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
    """Owns the workers the coordinator knows (by id), the key each registered with, and the
    index of what their prefix caches hold (``kv``): who may say what (``admit``), who is
    alive (``expire``), and the figures placement and admission read."""

    heartbeat_timeout_s: float = 5.0
    workers: dict[str, Worker] = field(default_factory=dict)
    # worker id -> the CURVE identity (z85 public key) that registered it; "" when insecure
    owners: dict[str, str] = field(default_factory=dict)
    refusals: RateLimitedLog = field(default_factory=RateLimitedLog)
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))
    kv: KVIndex = field(default_factory=KVIndex)  # which worker caches which block

    def admit(self, msg: m.Message, sender: str) -> bool:
        """Whether ``sender`` may say ``msg``: a live worker id speaks only with the key that
        registered it, and its numbers must fit what it registered. Refusals are logged."""
        if isinstance(msg, m.Register):
            return self._admit_register(msg, sender)
        worker_id = getattr(msg, "worker_id", None)
        if not isinstance(msg, WORKER_MESSAGES) or worker_id is None:
            return True
        owner = self.owners.get(worker_id)
        if owner is not None and owner != sender:
            self.refusals.error(
                f"impostor {type(msg).__name__} {worker_id} {sender}",
                "refused %s for worker %s from key %s: the worker registered with key %s",
                type(msg).__name__,
                worker_id,
                sender or "(none)",
                owner or "(none)",
            )
            return False
        known = self.workers.get(worker_id)
        if isinstance(msg, (m.Heartbeat, m.Reserved)) and known is not None:
            problem = heartbeat_problem(msg, known.info.num_blocks)
            if problem is not None:
                self.refusals.error(
                    f"heartbeat {worker_id} {problem.split('=')[0]}",
                    "refused a %s of %s: %s",
                    "heartbeat" if isinstance(msg, m.Heartbeat) else "reservation",
                    worker_id,
                    problem,
                )
                return False
        if isinstance(msg, m.KVEvents) and known is not None:
            problem = kv_events_problem(msg, known.info.num_blocks)
            if problem is not None:
                self.refusals.error(
                    f"kv events {worker_id}", "refused kv events of %s: %s", worker_id, problem
                )
                return False
        return True

    def _admit_register(self, info: m.Register, sender: str) -> bool:
        problem = register_problem(info)
        if problem is not None:
            self.refusals.error(
                f"register {info.worker_id}", "refusing worker %s: %s", info.worker_id, problem
            )
            return False
        owner = self.owners.get(info.worker_id)
        if info.worker_id in self.workers and owner is not None and owner != sender:
            self.refusals.error(
                f"impostor {info.worker_id} {sender}",
                "refused Register of live worker %s from key %s: it registered with key %s",
                info.worker_id,
                sender or "(none)",
                owner or "(none)",
            )
            return False
        self.owners[info.worker_id] = sender
        return True

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
        self.kv.drop(info.worker_id)  # a new process: its cache starts from its own events

    def heartbeat(self, hb: m.Heartbeat, now: float) -> bool:
        worker = self.workers.get(hb.worker_id)
        if worker is None:
            return False
        worker.last_seen = now
        worker.free_blocks, worker.used_blocks = hb.free_blocks, hb.used_blocks
        worker.running, worker.waiting = hb.running, hb.waiting
        worker.queued_prompt_tokens = hb.queued_prompt_tokens
        worker.counters = hb.counters
        if hb.draining and not worker.draining:
            logger.info("worker %s is draining: no new work goes to it", worker.worker_id)
        worker.draining = hb.draining
        return True

    def kv_events(self, ev: m.KVEvents) -> None:
        """A registered worker's prefix-cache changes into the index (``admit`` checked it)."""
        worker = self.workers.get(ev.worker_id)
        if worker is None:
            return  # before its Register: its cache was empty, or its next snapshot tells
        problem = self.kv.apply(ev, worker.info.num_blocks)
        if problem is not None:
            self.refusals.error(
                f"kv index {ev.worker_id}", "forgot the cache of %s: %s", ev.worker_id, problem
            )

    def expire(self, now: float) -> list[Worker]:
        """Drop and return workers silent for longer than the heartbeat timeout."""
        dead = [w for w in self.workers.values() if now - w.last_seen > self.heartbeat_timeout_s]
        for w in dead:
            logger.warning("worker %s (%s) missed its heartbeats", w.worker_id, w.info.role)
            del self.workers[w.worker_id]
            self.owners.pop(w.worker_id, None)  # a dead id may be taken by any key again
            self.kv.drop(w.worker_id)
        return dead

    # ---- pairing ---------------------------------------------------------------------------
    def models(self) -> set[str]:
        return {w.info.model for w in self.workers.values()}

    def disaggregated(self, model: str) -> bool:
        """Split pools: some worker only prefills. Else every worker runs both phases."""
        return any(w.info.role == "prefill" for w in self._serving(model))

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

    def has_decoder(self, model: str, avoid: Collection[str] = ()) -> bool:
        """Some decode worker of ``model`` takes work (not draining, not in ``avoid``)."""
        return any(w.can_decode and w.worker_id not in avoid for w in self._serving(model))

    def _serving(self, model: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.info.model == model and not w.draining]

    # ---- reporting -------------------------------------------------------------------------
    def cluster_state(self) -> m.ClusterState:
        models: dict[str, m.ServedModel] = {}
        for w in self.workers.values():
            name = w.info.model
            if name not in models:
                models[name] = m.ServedModel(
                    name=name,
                    root=w.info.model_root,
                    max_model_len=w.info.max_model_len,
                    ready=self.ready(name),
                )
        workers = [
            m.WorkerStatus(
                role=w.info.role,
                worker_id=w.worker_id,
                model=w.info.model,
                used_blocks=w.used_blocks,
                total_blocks=w.info.num_blocks,
                running=w.running,
                waiting=w.waiting,
                counters=w.counters,
            )
            for w in self.workers.values()
        ]
        return m.ClusterState(
            models=sorted(models.values(), key=lambda s: s.name),
            workers=workers,
            coordinator_id=self.instance_id,
        )

    # ---- figures for placement and admission ----------------------------------------------
    def prefill_queue_tokens(self, model: str, avoid: Collection[str]) -> int | None:
        """The shortest prefill queue (prompt tokens) of the model's answering prefill workers;
        None when it has none."""
        queues = [
            w.queued_prompt_tokens
            for w in self._serving(model)
            if w.info.role == "prefill" and w.worker_id not in avoid
        ]
        return min(queues) if queues else None

    def block_size(self, model: str) -> int:
        """Tokens per KV block of ``model`` (every worker of a model has the same layout)."""
        for w in self.workers.values():
            if w.info.model == model:
                return w.info.layout.block_size
        raise LookupError(f"no worker serves {model}")

    def max_model_len(self, model: str) -> int:
        """The longest context a worker of ``model`` registered (0: none said)."""
        lengths = [w.info.max_model_len for w in self.workers.values() if w.info.model == model]
        return max(lengths, default=0)

    def decode_capacity(self, model: str) -> tuple[int, int]:
        """(blocks, block size) of the largest decode-capable worker of ``model``: what one
        request can ever hold. (0, 1) when none serves it."""
        pool = [w for w in self.workers.values() if w.info.model == model and w.can_decode]
        if not pool:
            return 0, 1
        best = max(pool, key=lambda w: w.info.num_blocks)
        return best.info.num_blocks, best.info.layout.block_size

    def free_blocks_answered(self, worker_id: str, free_blocks: int, in_flight: int) -> None:
        """A decode worker's own free count in a ``Reserved``, less the blocks of reservations
        sent to it and not answered yet (``in_flight``), replaces the estimate."""
        worker = self.workers.get(worker_id)
        if worker is not None and 0 <= free_blocks <= worker.info.num_blocks:
            worker.free_blocks = max(0, free_blocks - in_flight)
