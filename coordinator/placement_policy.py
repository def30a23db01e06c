"""Which worker of a pool takes a choice: a pure decision over a list of candidates, by KV
cache and load (``kv``), by load alone (``load``), or in turn (``round-robin``); the mode is
``--routing``. ``coordinator.placement`` builds the candidates and acts on the pick.

Prefill cost of candidate w for a prompt of n tokens (``kv``); the lowest wins, a tie goes to
the shorter queue::

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

HOT_SPOT_TOKENS = 2048  # default guard: queued prompt tokens beyond the shortest queue
DECODE_HOT_SPOT_STREAMS = 16  # decode guard: running streams beyond the least busy worker


class RoutingMode(Enum):
    KV = "kv"
    LOAD = "load"
    ROUND_ROBIN = "round-robin"

    @classmethod
    def parse(cls, name: str | RoutingMode) -> RoutingMode:
        """The mode named ``name`` (``--routing``); ValueError naming the choices if none."""
        if isinstance(name, RoutingMode):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"routing must be one of {', '.join(ROUTING_MODES)}, got {name!r}"
            ) from None


ROUTING_MODES = tuple(mode.value for mode in RoutingMode)  # the CLI's choices


class PrefillReason(Enum):
    """Why a prefill worker was picked (counted in ``pdserve_routing_decisions_total``)."""

    KV_HIT = "prefill_kv_hit"  # the winner holds some of the prompt
    KV_MISS = "prefill_kv_miss"  # it holds none: no one does, or the ones that do are busier
    HOT_SPOT_GUARD = "prefill_hot_spot_guard"
    LOAD = "prefill_load"
    ROUND_ROBIN = "prefill_round_robin"


class DecodeReason(Enum):
    """Why a decode worker was picked by its cache (``kv`` mode with a known cache)."""

    KV_HIT = "decode_kv_hit"
    KV_MISS = "decode_kv_miss"
    HOT_SPOT_GUARD = "decode_hot_spot_guard"


@dataclass(frozen=True)
class Candidate:
    """One worker that can take the choice, as the policy sees it."""

    worker_id: str
    hit_blocks: int = 0  # leading blocks of the prompt its prefix cache holds
    queued_tokens: int = 0  # prompt tokens it has still to compute (prefill)
    free_blocks: int = 0  # KV blocks free (decode)
    running: int = 0  # streams it runs (decode)


@dataclass(frozen=True)
class PrefillPick:
    worker_id: str
    reason: PrefillReason
    compute: int  # prompt tokens it will compute (its queue grows by them)


@dataclass(frozen=True)
class DecodePick:
    worker_id: str
    reason: DecodeReason | None  # None: not placed by cache (load, round-robin, no cache known)


@dataclass(frozen=True)
class PlacementPolicy:
    """The placement decision: candidates in, a pick out. No state of its own: the worker
    picked last in turn (``last``) is an input."""

    mode: RoutingMode = RoutingMode.KV
    hot_spot_tokens: int = HOT_SPOT_TOKENS

    def __post_init__(self) -> None:
        if self.hot_spot_tokens < 0:
            raise ValueError(
                f"the hot-spot guard must be >= 0 tokens (0: off), got {self.hot_spot_tokens}"
            )

    def prefill(
        self,
        prompt_tokens: int,
        block_size: int,
        pool: Sequence[Candidate],
        last: str | None = None,
    ) -> PrefillPick:
        """The prefill worker of ``pool`` (not empty) for a prompt of ``prompt_tokens``."""
        if self.mode is RoutingMode.ROUND_ROBIN:
            turn = in_turn(pool, last)
            return PrefillPick(turn.worker_id, PrefillReason.ROUND_ROBIN, prompt_tokens)
        if self.mode is RoutingMode.LOAD:
            least = least_queued(pool)
            return PrefillPick(least.worker_id, PrefillReason.LOAD, prompt_tokens)

        def compute(c: Candidate) -> int:
            return prompt_tokens - c.hit_blocks * block_size

        best = min(pool, key=lambda c: (compute(c) + c.queued_tokens, c.queued_tokens))
        if best.hit_blocks == 0:
            return PrefillPick(best.worker_id, PrefillReason.KV_MISS, compute(best))
        shortest = least_queued(pool)
        excess = best.queued_tokens - shortest.queued_tokens
        if self.hot_spot_tokens and excess > self.hot_spot_tokens:
            return PrefillPick(shortest.worker_id, PrefillReason.HOT_SPOT_GUARD, compute(shortest))
        return PrefillPick(best.worker_id, PrefillReason.KV_HIT, compute(best))

    def decode(
        self,
        need_blocks: int,
        pool: Sequence[Candidate],
        last: str | None = None,
        cache_known: bool = False,
    ) -> DecodePick:
        """The decode worker of ``pool`` (not empty, each with ``need_blocks`` free);
        ``cache_known``: the candidates' ``hit_blocks`` are known (``kv`` places by them)."""
        if self.mode is RoutingMode.ROUND_ROBIN:
            return DecodePick(in_turn(pool, last).worker_id, None)
        if self.mode is RoutingMode.KV and cache_known:
            return self._decode_by_cache(need_blocks, pool)
        best = min(pool, key=lambda c: decode_cost(c, blocks_to_move=need_blocks))
        return DecodePick(best.worker_id, None)

    def _decode_by_cache(self, need: int, pool: Sequence[Candidate]) -> DecodePick:
        best = min(pool, key=lambda c: decode_cost(c, need - c.hit_blocks))
        if best.hit_blocks == 0:
            return DecodePick(best.worker_id, DecodeReason.KV_MISS)
        idle = min(pool, key=lambda c: decode_cost(c, need))
        if best.running > idle.running + DECODE_HOT_SPOT_STREAMS:
            return DecodePick(idle.worker_id, DecodeReason.HOT_SPOT_GUARD)
        return DecodePick(best.worker_id, DecodeReason.KV_HIT)


def decode_cost(c: Candidate, blocks_to_move: int) -> tuple[int, int, int]:
    """Lower is better: KV blocks to move into ``c``, then load (free blocks, running)."""
    return blocks_to_move, -c.free_blocks, c.running


def least_queued(pool: Sequence[Candidate]) -> Candidate:
    return min(pool, key=lambda c: c.queued_tokens)


def in_turn(pool: Sequence[Candidate], last: str | None) -> Candidate:
    """The candidate after ``last`` in id order (wrapping round; the first with no ``last``)."""
    ids = sorted(c.worker_id for c in pool)
    wid = next((i for i in ids if last is None or i > last), ids[0])
    return next(c for c in pool if c.worker_id == wid)
