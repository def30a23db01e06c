"""The coordinator's decisions, as pure policy objects: figures in, a decision out, no state
of their own (each has its own unit tests, tests/test_policy_*.py). The parts that act on them:
``coordinator.placement`` (placement), ``coordinator.dispatch`` (conditional disaggregation,
admission's queue) and ``coordinator.coordinator`` (admission's size check).

Placement (``PlacementPolicy``): which worker of a pool takes a choice, by KV cache and load
(``kv``), by load alone (``load``), or in turn (``round-robin``); the mode is ``--routing``.
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

Conditional disaggregation (``ConditionalDisaggPolicy``): whether a prompt is prefilled by its
decode worker itself (no KV transfer) rather than by a prefill worker::

    local_short_prompt   the part of the prompt not cached on its decode worker is at most
                         ``max_local_prefill_tokens`` (a conversation's next turn is short even
                         when its history is long)
    local_prefill_busy   every answering prefill worker has more than
                         ``max_prefill_queue_tokens`` prompt tokens queued

0 turns either rule off (the default: every prompt goes through a prefill worker).

Admission (``AdmissionPolicy``): whether a request can be taken at all, and whether a choice no
decode worker has room for now may wait for one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from pdserve.protocol.blocks import fork_blocks

HOT_SPOT_TOKENS = 2048  # default guard: queued prompt tokens beyond the shortest queue
DECODE_HOT_SPOT_STREAMS = 16  # decode guard: running streams beyond the least busy worker
MAX_QUEUED = 4096  # choices waiting for decode blocks at once (the rest fail at once, 503)

# ---- placement -------------------------------------------------------------------------------


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


# ---- conditional disaggregation --------------------------------------------------------------


class LocalReason(Enum):
    """Why a prompt is prefilled where it decodes (counted in
    ``pdserve_routing_decisions_total`` by its value)."""

    SHORT_PROMPT = "local_short_prompt"
    PREFILL_BUSY = "local_prefill_busy"
    NO_PREFILL = "local_no_prefill"  # the model has no live prefill worker (degraded)


@dataclass(frozen=True)
class ConditionalDisaggPolicy:
    """The two thresholds, in prompt tokens (0: that rule off)."""

    max_local_prefill_tokens: int = 0
    max_prefill_queue_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_local_prefill_tokens < 0 or self.max_prefill_queue_tokens < 0:
            raise ValueError("the local-prefill thresholds must be >= 0 (0: off)")

    @property
    def enabled(self) -> bool:
        return self.max_local_prefill_tokens > 0 or self.max_prefill_queue_tokens > 0

    def reason(
        self,
        prompt_tokens: int,
        decode_cached_tokens: int,
        prefill_queue_tokens: int | None,
    ) -> LocalReason | None:
        """Why a prompt of ``prompt_tokens``, ``decode_cached_tokens`` of them cached on the
        decode worker that would take it, is prefilled there while the shortest prefill queue
        holds ``prefill_queue_tokens`` (None: no prefill worker answers); None: by a prefill
        worker."""
        limit = self.max_local_prefill_tokens
        if limit > 0 and prompt_tokens > 0 and prompt_tokens - decode_cached_tokens <= limit:
            return LocalReason.SHORT_PROMPT
        busy = self.max_prefill_queue_tokens
        if busy > 0 and prefill_queue_tokens is not None and prefill_queue_tokens > busy:
            return LocalReason.PREFILL_BUSY
        return None


# ---- admission -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionPolicy:
    """A request that can never fit fails at once (400, not worth retrying); a choice may wait
    for blocks only while the queue has room and some decode worker answers (else 503)."""

    max_queued: int = MAX_QUEUED

    def too_big(
        self,
        prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        decode_blocks: int,
        block_size: int,
        choices: int = 1,
    ) -> str | None:
        """Why a prompt of ``prompt_tokens`` plus ``max_tokens`` can never run: beyond the
        model's context length ``max_model_len``, or a prompt whose KV alone (with token 0's
        slot for each of ``choices``) exceeds the whole KV cache (``decode_blocks`` of
        ``block_size`` tokens) of its largest decode worker; None when it can. ``max_tokens``
        books no KV: a sequence grows as it decodes, preempted and recomputed when its worker
        runs out. 0 for either limit: not known (no worker said)."""
        tokens = prompt_tokens + max_tokens
        if max_model_len and tokens > max_model_len:
            return (
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
                f"the model's context length of {max_model_len} tokens"
            )
        need = fork_blocks(prompt_tokens, choices, block_size)
        if decode_blocks and need > decode_blocks:
            return (
                f"the prompt ({prompt_tokens} tokens, {choices} choice(s)) needs "
                f"{need * block_size} tokens of KV cache, more than the "
                f"{decode_blocks * block_size} the largest decode worker holds"
            )
        return None

    def can_queue(self, queued: int, decoder_answers: bool) -> bool:
        """Whether one more choice may wait for decode blocks, with ``queued`` waiting already;
        ``decoder_answers``: some decode worker of its model takes work and is not silent."""
        return queued < self.max_queued and decoder_answers
