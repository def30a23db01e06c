"""Which worker of a pool takes a choice: by KV cache and load (``kv``), by load alone
(``load``), or in turn (``round-robin``); the mode is ``--routing``.

Prefill cost of worker w for a prompt of n tokens (``kv``); the lowest wins, a tie goes to the
shorter queue::

    cost(w) = n - hit(w) * block_size    prompt tokens w must compute: its prefix cache holds
                                         the first hit(w) blocks (coordinator.kv_index)
            + queued(w)                  prompt tokens w has still to compute before this one

Hot-spot guard: a popular prefix cached on one worker draws every request that shares it for as
long as its hit outweighs that worker's queue. When the winner's queue is more than
``hot_spot_tokens`` longer than the shortest one, the shortest queue takes the request instead
(and caches the prefix too, so the next ones spread by cost alone).

Decode cost, the lowest wins: ``(blocks to move, -free blocks, running)``, where blocks to
move is ``need - hit(w)``: a decode worker reserves the prompt blocks its own cache holds
instead of receiving them (``engine.reserve_prompt``), so a conversation's next turn goes back
to the worker holding its history. Guard: when that worker runs more than
``DECODE_HOT_SPOT_STREAMS`` streams beyond the least busy one, load decides instead.

Prefill placements by reason, in ``decisions`` (the coordinator adds them to its own in
``pdserve_routing_decisions_total``): ``prefill_kv_hit`` (the winner holds some of the prompt),
``prefill_kv_miss`` (it holds none: no worker does, or the ones that do are busier by more than
their hit), ``prefill_hot_spot_guard``, ``prefill_load``, ``prefill_round_robin``; decode
placements by cache in ``decode_decisions``: ``decode_kv_hit``, ``decode_kv_miss``,
``decode_hot_spot_guard``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from pdserve.coordinator.registry import Worker, WorkerRegistry
from pdserve.protocol.prefix import cacheable_hashes

ROUTING_MODES = ("kv", "load", "round-robin")
HOT_SPOT_TOKENS = 2048  # default guard: queued prompt tokens beyond the shortest queue
DECODE_HOT_SPOT_STREAMS = 16  # decode guard: running streams beyond the least busy worker


class Placement:
    def __init__(
        self,
        registry: WorkerRegistry,
        mode: str = "kv",
        hot_spot_tokens: int = HOT_SPOT_TOKENS,
    ) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_MODES)}, got {mode!r}")
        if hot_spot_tokens < 0:
            raise ValueError(
                f"the hot-spot guard must be >= 0 tokens (0: off), got {hot_spot_tokens}"
            )
        self.registry = registry
        self.decisions: Counter[str] = Counter()  # prefill placements by reason
        self.decode_decisions: Counter[str] = Counter()  # decode placements by cache
        self.mode = mode
        self.hot_spot_tokens = hot_spot_tokens
        self._last: dict[tuple[str, str], str] = {}  # (model, pool) -> last worker in turn

    def pick_prefill(self, model: str, prompt: list[int], avoid: Collection[str]) -> Worker | None:
        """A prefill worker for ``prompt`` (none of ``avoid``); its queue estimate grows by
        what it will compute, until its next heartbeat."""
        pool = [
            w
            for w in self.registry.workers.values()
            if w.info.model == model
            and w.info.role == "prefill"
            and not w.draining
            and w.worker_id not in avoid
        ]
        if not pool:
            return None
        if self.mode == "kv":
            best, reason, compute = self._by_cache(prompt, pool)
        else:
            turn = self.mode == "round-robin"
            best = self._in_turn(model, "prefill", pool) if turn else _least_queued(pool)
            reason, compute = self.mode.replace("-", "_"), len(prompt)
        self.decisions[f"prefill_{reason}"] += 1
        best.queued_prompt_tokens += compute
        return best

    def pick_decode(
        self,
        model: str,
        need_blocks: int,
        avoid: Collection[str],
        prompt: list[int] | None = None,
    ) -> Worker | None:
        """A decode worker with ``need_blocks`` free (none of ``avoid``), the one holding most
        of ``prompt`` when given (``kv``); its free-block estimate drops by them, until its
        next heartbeat or ``Reserved``."""
        pool = [
            w
            for w in self.registry.workers.values()
            if w.info.model == model
            and w.can_decode
            and not w.draining
            and w.free_blocks >= need_blocks
            and w.worker_id not in avoid
        ]
        if not pool:
            return None
        if self.mode == "round-robin":
            best = self._in_turn(model, "decode", pool)
        elif self.mode == "kv" and prompt is not None and self.registry.kv.holders:
            best = self._decode_by_cache(prompt, need_blocks, pool)
        else:
            best = min(pool, key=lambda w: decode_cost(w, blocks_to_move=need_blocks))
        best.free_blocks -= need_blocks
        return best

    def decode_hit_tokens(self, model: str, prompt: list[int]) -> int:
        """Leading tokens of ``prompt`` the decode worker holding most of it has cached
        (``kv`` mode: the one ``pick_decode`` favours; 0 in the others, blind to caches)."""
        if self.mode != "kv" or not self.registry.kv.holders:
            return 0
        pool = [
            w
            for w in self.registry.workers.values()
            if w.info.model == model and w.can_decode and not w.draining
        ]
        if not pool:
            return 0
        block_size = pool[0].info.layout.block_size
        hashes = cacheable_hashes(prompt, block_size)
        hits = self.registry.kv.prefix_blocks(hashes, [w.worker_id for w in pool])
        return max(hits.values(), default=0) * block_size

    def _decode_by_cache(self, prompt: list[int], need: int, pool: list[Worker]) -> Worker:
        hashes = cacheable_hashes(prompt, pool[0].info.layout.block_size)
        hits = self.registry.kv.prefix_blocks(hashes, [w.worker_id for w in pool])
        best = min(pool, key=lambda w: decode_cost(w, need - hits[w.worker_id]))
        if hits[best.worker_id] == 0:
            self.decode_decisions["decode_kv_miss"] += 1
            return best
        idle = min(pool, key=lambda w: decode_cost(w, need))
        if best.running > idle.running + DECODE_HOT_SPOT_STREAMS:
            self.decode_decisions["decode_hot_spot_guard"] += 1
            return idle
        self.decode_decisions["decode_kv_hit"] += 1
        return best

    def _by_cache(self, prompt: list[int], pool: list[Worker]) -> tuple[Worker, str, int]:
        """(worker, reason, prompt tokens it will compute) by the cost in the module doc."""
        block_size = pool[0].info.layout.block_size
        kv = self.registry.kv
        hashes = cacheable_hashes(prompt, block_size) if kv.holders else []
        hits = kv.prefix_blocks(hashes, [w.worker_id for w in pool])

        def compute(w: Worker) -> int:
            return len(prompt) - hits[w.worker_id] * block_size

        best = min(
            pool, key=lambda w: (compute(w) + w.queued_prompt_tokens, w.queued_prompt_tokens)
        )
        if hits[best.worker_id] == 0:
            return best, "kv_miss", compute(best)
        shortest = _least_queued(pool)
        excess = best.queued_prompt_tokens - shortest.queued_prompt_tokens
        if self.hot_spot_tokens and excess > self.hot_spot_tokens:
            return shortest, "hot_spot_guard", compute(shortest)
        return best, "kv_hit", compute(best)

    def _in_turn(self, model: str, pool_name: str, pool: list[Worker]) -> Worker:
        """The worker after the last one picked, in id order (wrapping round)."""
        ids = sorted(w.worker_id for w in pool)
        last = self._last.get((model, pool_name))
        wid = next((i for i in ids if last is None or i > last), ids[0])
        self._last[(model, pool_name)] = wid
        return next(w for w in pool if w.worker_id == wid)


def decode_cost(w: Worker, blocks_to_move: int) -> tuple[int, int, int]:
    """Lower is better: KV blocks to move into ``w``, then load (free blocks, running)."""
    return blocks_to_move, -w.free_blocks, w.running


def _least_queued(pool: list[Worker]) -> Worker:
    return min(pool, key=lambda w: w.queued_prompt_tokens)
