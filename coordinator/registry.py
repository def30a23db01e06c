"""The workers the coordinator knows, and what it believes of them: what each registered, its
load as last reported (``WorkerLoad``, estimated between heartbeats), and whether it is alive.

A worker's id is bound to the key that registered it, and the numbers it reports must fit what
it registered: its figures steer placement (the most free blocks, the fewest queued tokens
win), so an impossible one (a billion blocks, a negative queue) would draw every request. Such
a message is refused and logged (``admit``), never clipped into something plausible.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from dataclasses import dataclass, field
from enum import Enum

from pdserve.coordinator.counter_checks import counters_problem
from pdserve.coordinator.kv_index import KVIndex, kv_events_problem
from pdserve.kvtransfer.base import LayoutMismatchError, check_layouts
from pdserve.protocol import messages as m
from pdserve.protocol.control import (
    MAX_TENSOR_PARALLEL_SIZE,
    Heartbeat,
    KVEvents,
    Register,
    WorkerCounters,
    WorkerLoad,
)
from pdserve.runtime.loop import RateLimitedLog

logger = logging.getLogger(__name__)

# what only the worker itself may say: checked against the key that registered its id
WORKER_MESSAGES = (Heartbeat, m.Reserved, m.Finished, KVEvents)
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,  # --kv-cache-dtype int8: the layout's head_dim counts a row's scale bytes too
}
MAX_KV_BYTES = 64 << 40  # one worker's KV cache: more than any node holds (64 TiB)
MAX_LAYOUT = {"block_size": 4096, "num_layers": 1024, "num_kv_heads": 1024, "head_dim": 4096}
MAX_MODEL_LEN = 1 << 24
MAX_REQUESTS = 1 << 20  # running or waiting on one worker
MAX_QUEUED_TOKENS = 1 << 40


@dataclass
class Worker:
    """One registered worker: what it registered, and its load as last reported (or estimated
    since: ``expect``, ``coordinator.placement``)."""

    info: Register
    last_seen: float
    load: WorkerLoad
    counters: WorkerCounters = field(default_factory=WorkerCounters)

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def can_prefill(self) -> bool:
        return self.info.role == "prefill" or self.info.role == "both"

    @property
    def can_decode(self) -> bool:
        return self.info.role == "decode" or self.info.role == "both"

    def expect(self, *, prompt_tokens: int = 0, blocks: int = 0, growth: int = 0) -> None:
        """Work sent since its last heartbeat: a prefill job queues ``prompt_tokens``, a
        reservation takes ``blocks`` and is expected to grow by ``growth`` more as it decodes,
        until the next heartbeat gives its own figures."""
        load = self.load
        self.load = dataclasses.replace(
            load,
            queued_prompt_tokens=load.queued_prompt_tokens + prompt_tokens,
            free_blocks=load.free_blocks - blocks,
            growth_blocks=load.growth_blocks + growth,
        )

    @property
    def headroom(self) -> int:
        """Blocks free now less those its sequences are expected to take still as they decode:
        what a new request may count on (admission by need)."""
        return self.load.free_blocks - self.load.growth_blocks


class ModelState(Enum):
    """How a model takes new requests, from the workers serving it now (``WorkerRegistry.state``).
    Once its pools were whole, losing a part degrades it rather than refusing its requests."""

    READY = "ready"  # a worker can prefill and one can decode (an embedding model: one embeds)
    NO_PREFILL = "no_prefill"  # once ready; no prefill worker now: decode workers prefill too
    HOLDING = "holding"  # once ready; no worker can decode now: requests wait (--hold-timeout)
    ABSENT = "absent"  # never ready (starting), or unknown


@dataclass
class WorkerRegistry:
    """Owns the workers the coordinator knows (by id), the key each registered with, and the
    index of what their prefix caches hold (``kv``): who may say what (``admit``), who is
    alive (``expire``), and the cluster as gateways see it (``cluster_state``)."""

    heartbeat_timeout_s: float = 5.0
    workers: dict[str, Worker] = field(default_factory=dict)
    # worker id -> the CURVE identity (z85 public key) that registered it; "" when insecure
    owners: dict[str, str] = field(default_factory=dict)
    refusals: RateLimitedLog = field(default_factory=RateLimitedLog)
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))
    kv: KVIndex = field(default_factory=KVIndex)  # which worker caches which block
    # seconds a request waits for a model with no worker able to take it (0: refused at once)
    hold_s: float = 0.0
    # the models whose pools were whole once, as they were served then: degraded, not gone,
    # when workers leave (``state``)
    once_ready: dict[str, m.ServedModel] = field(default_factory=dict)

    def admit(self, msg: m.Message, sender: str) -> bool:
        """Whether ``sender`` may say ``msg``: a live worker id speaks only with the key that
        registered it, and its numbers must fit what it registered. Refusals are logged."""
        if isinstance(msg, Register):
            return self._admit_register(msg, sender)
        if not isinstance(msg, WORKER_MESSAGES):
            return True
        worker_id = msg.worker_id
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
        problem = None if known is None else figures_problem(msg, known.info.num_blocks)
        if problem is None:
            return True
        if isinstance(msg, KVEvents):
            self.refusals.error(
                f"kv events {worker_id}", "refused kv events of %s: %s", worker_id, problem
            )
        else:
            what = "heartbeat" if isinstance(msg, Heartbeat) else "reservation"
            key = f"heartbeat {worker_id} {problem.split('=')[0]}"
            self.refusals.error(key, "refused a %s of %s: %s", what, worker_id, problem)
        return False

    def _admit_register(self, info: Register, sender: str) -> bool:
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

    def register(self, info: Register, now: float) -> None:
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
        self.workers[info.worker_id] = Worker(info, now, WorkerLoad.idle(info.num_blocks))
        self.kv.drop(info.worker_id)  # a new process: its cache starts from its own events
        self.state(info.model)  # remembered once whole

    def heartbeat(self, hb: Heartbeat, now: float) -> bool:
        worker = self.workers.get(hb.worker_id)
        if worker is None:
            return False
        worker.last_seen = now
        if hb.load.draining and not worker.load.draining:
            logger.info("worker %s is draining: no new work goes to it", worker.worker_id)
        worker.load, worker.counters = hb.load, hb.counters
        return True

    def kv_events(self, ev: KVEvents) -> None:
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
            if w.load.draining:  # retired: its drain ended and it exited
                logger.info("worker %s (%s) drained and left", w.worker_id, w.info.role)
            else:
                logger.warning("worker %s (%s) missed its heartbeats", w.worker_id, w.info.role)
            del self.workers[w.worker_id]
            self.owners.pop(w.worker_id, None)  # a dead id may be taken by any key again
            self.kv.drop(w.worker_id)
        return dead

    def models(self) -> set[str]:
        return {w.info.model for w in self.workers.values()}

    def serving(self, model: str) -> list[Worker]:
        """The workers of ``model`` that take new work (not draining)."""
        return [w for w in self.workers.values() if w.info.model == model and not w.load.draining]

    def ready(self, model: str) -> bool:
        pool = self.serving(model)
        if self.embeds(model):
            return True
        return any(w.can_prefill for w in pool) and any(w.can_decode for w in pool)

    def state(self, model: str) -> ModelState:
        """How ``model`` takes new requests now (``ModelState``); a model whose pools are whole
        is remembered, so that losing its prefill pool, or every worker, degrades it."""
        if self.ready(model):
            if model not in self.once_ready:
                self.once_ready[model] = self._served(model)
            return ModelState.READY
        if model not in self.once_ready or self.once_ready[model].kind == "embed":
            return ModelState.ABSENT
        if any(w.can_decode for w in self.serving(model)):
            return ModelState.NO_PREFILL
        return ModelState.HOLDING if self.hold_s > 0 else ModelState.ABSENT

    def _served(self, model: str) -> m.ServedModel:
        """``model`` as gateways see it, from its first worker."""
        info = next(w.info for w in self.workers.values() if w.info.model == model)
        return m.ServedModel(
            name=model,
            root=info.model_root,
            max_model_len=info.max_model_len,
            ready=True,
            kind="embed" if info.role == "embed" else "generate",
        )

    def embeds(self, model: str) -> list[Worker]:
        """The embed workers of ``model`` that take new work: an embedding model has no
        other kind."""
        return [w for w in self.serving(model) if w.info.role == "embed"]

    def cluster_state(self) -> m.ClusterState:
        """The models (one taking requests degraded counts as ready: ``state``) and workers."""
        models: dict[str, m.ServedModel] = {}
        for name in {w.info.model for w in self.workers.values()} | set(self.once_ready):
            state = self.state(name)
            served = self.once_ready.get(name) or self._served(name)
            degraded = "" if state in (ModelState.READY, ModelState.ABSENT) else state.value
            ready = state is not ModelState.ABSENT
            models[name] = dataclasses.replace(served, ready=ready, degraded=degraded)
        workers = [
            m.WorkerStatus(
                role=w.info.role,
                worker_id=w.worker_id,
                model=w.info.model,
                load=w.load,
                counters=w.counters,
            )
            for w in self.workers.values()
        ]
        return m.ClusterState(
            models=sorted(models.values(), key=lambda s: s.name),
            workers=workers,
            coordinator_id=self.instance_id,
        )


# ---- what a worker's messages must fit -------------------------------------------------------


def register_problem(info: Register) -> str | None:
    """Why a ``Register`` cannot be true, or None."""
    layout = info.layout
    for name, limit in MAX_LAYOUT.items():
        value = getattr(layout, name)
        if not 1 <= value <= limit:
            return f"layout {name}={value} is outside [1, {limit}]"
    size = DTYPE_BYTES.get(layout.dtype)
    if size is None:
        return f"unknown KV dtype {layout.dtype!r}"
    block_bytes = 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * size
    block_bytes *= layout.num_layers
    if not 1 <= info.num_blocks <= MAX_KV_BYTES // block_bytes:
        return (
            f"num_blocks={info.num_blocks} is outside [1, {MAX_KV_BYTES // block_bytes}] "
            f"({block_bytes} bytes a block, at most {MAX_KV_BYTES >> 40} TiB of KV a worker)"
        )
    if not 0 <= info.max_model_len <= MAX_MODEL_LEN:
        return f"max_model_len={info.max_model_len} is outside [0, {MAX_MODEL_LEN}]"
    tp = info.tensor_parallel_size
    if not 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE:
        return f"tensor_parallel_size={tp} is outside [1, {MAX_TENSOR_PARALLEL_SIZE}]"
    return None


def figures_problem(msg: m.Message, num_blocks: int) -> str | None:
    """Why the figures in a worker's ``Heartbeat``, ``Reserved`` or ``KVEvents`` cannot be true
    of a worker that registered ``num_blocks``, or None."""
    if isinstance(msg, Heartbeat):
        return load_problem(msg.load, num_blocks) or counters_problem(msg.counters)
    if isinstance(msg, m.Reserved):
        ids_ok = all(0 <= b < num_blocks for b in msg.block_ids)
        if msg.free_blocks > num_blocks or not ids_ok:
            return f"free_blocks={msg.free_blocks} or block ids outside [0, {num_blocks})"
    if isinstance(msg, KVEvents):
        return kv_events_problem(msg, num_blocks)
    return None


def load_problem(load: WorkerLoad, num_blocks: int) -> str | None:
    if load.total_blocks != num_blocks:
        return f"total_blocks={load.total_blocks}, registered {num_blocks}"
    free, used = load.free_blocks, load.used_blocks
    if free < 0 or used < 0 or free + used > num_blocks:
        return f"free_blocks={free} used_blocks={used} of {num_blocks}"
    for name, value in (("running", load.running), ("waiting", load.waiting)):
        if not 0 <= value <= MAX_REQUESTS:
            return f"{name}={value} is outside [0, {MAX_REQUESTS}]"
    for name, value in (
        ("queued_prompt_tokens", load.queued_prompt_tokens),
        ("growth_blocks", load.growth_blocks),
        ("expected_output_tokens", load.expected_output_tokens),
    ):
        if not 0 <= value <= MAX_QUEUED_TOKENS:
            return f"{name}={value} is outside [0, {MAX_QUEUED_TOKENS}]"
    return None
