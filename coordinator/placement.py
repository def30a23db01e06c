"""Placing a choice on a worker of its model's pool: ``Placement`` finds the workers that can
take it, what each holds of the prompt (``coordinator.kv_index``), asks the policy
(``coordinator.policies.PlacementPolicy``) and acts on its pick; and it answers what the other
parts ask of a model's pool (is it split, its block size, its largest decode worker, its
shortest prefill queue).

Load between heartbeats is estimated here: a pick raises a prefill worker's queued prompt tokens
by what it will compute, and lowers a decode worker's free blocks by what it reserves, until the
worker's next heartbeat (or ``Reserved``) gives its own figures.

Placements by reason, in ``decisions`` (prefill: ``PrefillReason``) and ``decode_decisions``
(decode by cache: ``DecodeReason``); the coordinator adds them to its own in
``pdserve_routing_decisions_total``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection

from pdserve.coordinator.policies import HOT_SPOT_TOKENS, Candidate, PlacementPolicy, RoutingMode
from pdserve.coordinator.registry import Worker, WorkerRegistry
from pdserve.protocol.blocks import blocks_for
from pdserve.protocol.prefix import cacheable_hashes


class Placement:
    """Owns the pick of a prefill or a decode worker: the candidate pools, the load estimates a
    pick changes, the worker picked last of each pool (``round-robin``) and the counts of
    placements by reason. The decision itself is ``policy``'s."""

    def __init__(
        self,
        registry: WorkerRegistry,
        mode: RoutingMode = RoutingMode.KV,
        hot_spot_tokens: int = HOT_SPOT_TOKENS,
    ) -> None:
        self.registry = registry
        self.policy = PlacementPolicy(mode, hot_spot_tokens)
        self.decisions: Counter[str] = Counter()  # prefill placements by reason
        self.decode_decisions: Counter[str] = Counter()  # decode placements by cache
        self._last: dict[tuple[str, str], str] = {}  # (model, pool) -> last worker picked

    @property
    def mode(self) -> RoutingMode:
        return self.policy.mode

    def pick_prefill(self, model: str, prompt: list[int], avoid: Collection[str]) -> Worker | None:
        """A prefill worker for ``prompt`` (none of ``avoid``); its queue estimate grows by
        what it will compute, until its next heartbeat."""
        pool = [
            w
            for w in self.registry.serving(model)
            if w.info.role == "prefill" and w.worker_id not in avoid
        ]
        if not pool:
            return None
        block_size = pool[0].info.layout.block_size
        # ``kv`` counts a miss even with nothing cached anywhere (no hashing then)
        by_cache = self.mode is RoutingMode.KV and bool(self.registry.kv.holders)
        hits = self._hits(prompt, pool) if by_cache else {}
        candidates = [
            Candidate(
                w.worker_id,
                hit_blocks=hits.get(w.worker_id, 0),
                queued_tokens=w.load.queued_prompt_tokens,
            )
            for w in pool
        ]
        last = self._last.get((model, "prefill"))
        pick = self.policy.prefill(len(prompt), block_size, candidates, last)
        self._last[(model, "prefill")] = pick.worker_id
        self.decisions[pick.reason.value] += 1
        best = self.registry.workers[pick.worker_id]
        best.expect(prompt_tokens=pick.compute)
        return best

    def pick_decode(
        self,
        model: str,
        need_blocks: int,
        avoid: Collection[str],
        prompt: list[int] | None = None,
        max_tokens: int = 0,
        room: bool = True,
    ) -> Worker | None:
        """A decode worker with ``need_blocks`` free (none of ``avoid``), ranked by headroom
        (free blocks less its sequences' expected growth), the one holding most of ``prompt``
        when given (``kv``); its estimates change by the reservation and the growth expected of
        a request asking ``max_tokens``, until its next heartbeat or ``Reserved``.
        ``room=False``: a worker whose whole cache holds ``need_blocks`` will do (its engine
        makes room).

        The growth estimate ranks; it does not hold a request back. Held back at the
        coordinator by it (SGLang's way), 24 of the first 49 of 64 requests, each taking its
        whole 1,024 tokens of a 256 MiB cache 32 at a time, waited past the queue's bound and
        got 503s (bench/experiments/kv_by_need.py); admitted on the blocks free now, every one
        is served, the engine preempting where the estimate would have been right."""
        pool = [
            w
            for w in self.registry.serving(model)
            if w.can_decode
            and (w.load.free_blocks if room else w.info.num_blocks) >= need_blocks
            and w.worker_id not in avoid
        ]
        if not pool:
            return None
        by_cache = (
            self.mode is RoutingMode.KV and prompt is not None and bool(self.registry.kv.holders)
        )
        hits = self._hits(prompt, pool) if by_cache and prompt is not None else {}
        candidates = [
            Candidate(
                w.worker_id,
                hit_blocks=hits.get(w.worker_id, 0),
                free_blocks=w.headroom,
                running=w.load.running,
            )
            for w in pool
        ]
        last = self._last.get((model, "decode"))
        pick = self.policy.decode(need_blocks, candidates, last, cache_known=by_cache)
        self._last[(model, "decode")] = pick.worker_id
        if pick.reason is not None:
            self.decode_decisions[pick.reason.value] += 1
        best = self.registry.workers[pick.worker_id]
        best.expect(blocks=need_blocks, growth=self._growth(best, need_blocks, prompt, max_tokens))
        return best

    @staticmethod
    def _growth(worker: Worker, need: int, prompt: list[int] | None, max_tokens: int) -> int:
        """Blocks a new request is expected to take on ``worker`` past the ``need`` it
        reserves: its output as long as the worker's outputs run (none learned: 0)."""
        expected = min(worker.load.expected_output_tokens, max_tokens)
        if prompt is None or expected <= 0:
            return 0
        tokens = len(prompt) + expected
        return max(0, blocks_for(tokens, worker.info.layout.block_size) - need)

    def pick_colocated(self, model: str, tokens: int) -> Worker | None:
        """A worker of a pool whose workers all run both phases: the least busy one."""
        pool = [w for w in self.registry.serving(model) if w.info.role == "both"]
        if not pool:
            return None
        best = min(
            pool,
            key=lambda w: (w.load.queued_prompt_tokens + w.load.running, -w.load.free_blocks),
        )
        best.expect(prompt_tokens=tokens)
        return best

    def free_blocks_answered(self, worker_id: str, free_blocks: int, in_flight: int) -> None:
        """A decode worker's own free count in a ``Reserved``, less the blocks of reservations
        sent to it and not answered yet (``in_flight``), replaces the estimate."""
        worker = self.registry.workers.get(worker_id)
        if worker is not None and 0 <= free_blocks <= worker.info.num_blocks:
            free = max(0, free_blocks - in_flight)
            worker.load = dataclasses.replace(worker.load, free_blocks=free)

    def decode_hit_tokens(self, model: str, prompt: list[int]) -> int:
        """Leading tokens of ``prompt`` the decode worker holding most of it has cached
        (``kv`` mode: the one ``pick_decode`` favours; 0 in the others, blind to caches)."""
        if self.mode is not RoutingMode.KV or not self.registry.kv.holders:
            return 0
        pool = [w for w in self.registry.serving(model) if w.can_decode]
        if not pool:
            return 0
        hits = self._hits(prompt, pool)
        return max(hits.values(), default=0) * pool[0].info.layout.block_size

    def _hits(self, prompt: list[int], pool: list[Worker]) -> dict[str, int]:
        """Each worker's run of the prompt's leading blocks its prefix cache holds."""
        hashes = cacheable_hashes(prompt, pool[0].info.layout.block_size)
        return self.registry.kv.prefix_blocks(hashes, [w.worker_id for w in pool])

    # ---- what the other parts ask of a model's pool -------------------------------------------
    def disaggregated(self, model: str) -> bool:
        """Split pools: some worker only prefills. Else every worker runs both phases."""
        return any(w.info.role == "prefill" for w in self.registry.serving(model))

    def has_decoder(self, model: str, avoid: Collection[str] = ()) -> bool:
        """Some decode worker of ``model`` takes work (not draining, not in ``avoid``)."""
        pool = self.registry.serving(model)
        return any(w.can_decode and w.worker_id not in avoid for w in pool)

    def prefill_queue_tokens(self, model: str, avoid: Collection[str]) -> int | None:
        """The shortest prefill queue (prompt tokens) of the model's answering prefill workers;
        None when it has none."""
        queues = [
            w.load.queued_prompt_tokens
            for w in self.registry.serving(model)
            if w.info.role == "prefill" and w.worker_id not in avoid
        ]
        return min(queues) if queues else None

    def block_size(self, model: str) -> int:
        """Tokens per KV block of ``model`` (every worker of a model has the same layout)."""
        for w in self.registry.workers.values():
            if w.info.model == model:
                return w.info.layout.block_size
        raise LookupError(f"no worker serves {model}")

    def max_model_len(self, model: str) -> int:
        """The longest context a worker of ``model`` registered (0: none said)."""
        workers = self.registry.workers.values()
        return max((w.info.max_model_len for w in workers if w.info.model == model), default=0)

    def decode_capacity(self, model: str) -> tuple[int, int]:
        """(blocks, block size) of the largest decode-capable worker of ``model``: what one
        request can ever hold. (0, 1) when none serves it."""
        workers = self.registry.workers.values()
        pool = [w for w in workers if w.info.model == model and w.can_decode]
        if not pool:
            return 0, 1
        best = max(pool, key=lambda w: w.info.num_blocks)
        return best.info.num_blocks, best.info.layout.block_size
