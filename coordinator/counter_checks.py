"""What a worker's totals (``WorkerCounters``, in each heartbeat) must fit to be a worker's.

They are only shown in ``/metrics``, but never as garbage: a negative count, a sum that is not
finite, a histogram of the wrong shape or a label no worker sends is refused with the rest of
the heartbeat (``registry.figures_problem``), never clipped into something plausible.
"""

from __future__ import annotations

import math

from pdserve.protocol.control import (
    MAX_SPEC_POSITIONS,
    OVER_TARGET_REASONS,
    SPEC_MODES,
    SPEC_STEP_REASONS,
    STEP_DECODE_SEQS_BUCKETS,
    STEP_KINDS,
    STEP_MODEL_TERMS,
    STEP_PREFILL_TOKENS_BUCKETS,
    STEP_SECONDS_BUCKETS,
    TRANSFER_SECONDS_BUCKETS,
    SpecCounters,
    StepCounters,
    StepHistogram,
    WorkerCounters,
)

MAX_COUNT = 1 << 63  # counts and integer sums lie in [0, MAX_COUNT)
MAX_TPOT_TARGET_S = 1e4  # a target past this (hours a token) is no target a worker sets


def counters_problem(c: WorkerCounters) -> str | None:
    """Why a worker's totals cannot be true, or None."""
    totals = (
        c.prefix_hit_tokens,
        c.prefill_tokens,
        c.preemptions,
        c.recomputed_tokens,
        c.kv_blocks_sent,
        c.kv_bytes_sent,
        c.kv_transfers_failed,
    )
    if any(not 0 <= v < MAX_COUNT for v in (*totals, *c.transfer_seconds_counts)):
        return "a counter outside [0, 2**63)"
    if not 0.0 <= c.transfer_seconds_sum < float(MAX_COUNT):  # NaN fails too
        return f"transfer_seconds_sum={c.transfer_seconds_sum}"
    if len(c.transfer_seconds_counts) not in (0, len(TRANSFER_SECONDS_BUCKETS) + 1):
        return f"{len(c.transfer_seconds_counts)} transfer-time buckets"
    return steps_problem(c.steps) or spec_problem(c.spec)


def steps_problem(s: StepCounters) -> str | None:
    """Why a worker's engine steps (``StepCounters``) cannot be true, or None."""
    if not 0.0 <= s.tpot_target_s <= MAX_TPOT_TARGET_S:  # NaN fails too
        return f"tpot_target_s={s.tpot_target_s} is outside [0, {MAX_TPOT_TARGET_S:g}]"
    if len(s.model) not in (0, len(STEP_MODEL_TERMS)):
        return f"a step model of {len(s.model)} terms, not 0 or {len(STEP_MODEL_TERMS)}"
    if not all(0.0 <= x < math.inf for x in s.model):
        return f"step model={s.model}: a term negative or not finite"
    for reason, count in s.over_target.items():
        if reason not in OVER_TARGET_REASONS:
            reasons = ", ".join(OVER_TARGET_REASONS)
            return f"over-target reason={reason[:40]!r} is not one of {reasons}"
        if not 0 <= count < MAX_COUNT:
            return f"over_target {reason}={count} is outside [0, 2**63)"
    for kind, histogram in s.by_kind.items():
        if kind not in STEP_KINDS:
            return f"step kind={kind[:40]!r} is not one of {', '.join(STEP_KINDS)}"
        problem = _histogram_problem(histogram)
        if problem is not None:
            return f"{kind} steps: {problem}"
    return None


def spec_problem(s: SpecCounters) -> str | None:
    """Why a worker's speculative decoding (``SpecCounters``) cannot be true, or None. Each
    draft position's accepted is at most its drafted; drafted need not fall from one position
    to the next (not checked)."""
    if s.mode not in SPEC_MODES:
        return f"speculative mode={s.mode[:40]!r} is not one of {', '.join(SPEC_MODES)}"
    if len(s.drafted) != len(s.accepted):
        return f"{len(s.drafted)} drafted positions but {len(s.accepted)} accepted"
    if len(s.drafted) > MAX_SPEC_POSITIONS:
        return f"{len(s.drafted)} draft positions, more than {MAX_SPEC_POSITIONS}"
    positions = zip(s.drafted, s.accepted, strict=True)
    for position, (drafted, accepted) in enumerate(positions, start=1):
        if not (0 <= drafted < MAX_COUNT and 0 <= accepted < MAX_COUNT):
            return f"draft position {position}: a count outside [0, 2**63)"
        if accepted > drafted:
            return f"draft position {position}: {accepted} accepted of {drafted} drafted"
    for reason, count in s.steps.items():
        if reason not in SPEC_STEP_REASONS:
            reasons = ", ".join(SPEC_STEP_REASONS)
            return f"speculative step reason={reason[:40]!r} is not one of {reasons}"
        if not 0 <= count < MAX_COUNT:
            return f"speculative steps {reason}={count} is outside [0, 2**63)"
    for name, total in (
        ("draft_tokens", s.draft_tokens),
        ("draft_prompt_tokens", s.draft_prompt_tokens),
    ):
        if not 0 <= total < MAX_COUNT:
            return f"{name}={total} is outside [0, 2**63)"
    if s.draft_prompt_tokens > s.draft_tokens:
        return f"draft_prompt_tokens={s.draft_prompt_tokens} > draft_tokens={s.draft_tokens}"
    return None


def _histogram_problem(h: StepHistogram) -> str | None:
    """Why one kind's histograms cannot be a worker's, or None."""
    shapes = (
        ("seconds", h.seconds_counts, STEP_SECONDS_BUCKETS),
        ("prefill_tokens", h.prefill_tokens_counts, STEP_PREFILL_TOKENS_BUCKETS),
        ("decode_seqs", h.decode_seqs_counts, STEP_DECODE_SEQS_BUCKETS),
    )
    for name, counts, bounds in shapes:
        if len(counts) != len(bounds) + 1:
            return f"{len(counts)} {name} buckets, not {len(bounds) + 1}"
        if any(not 0 <= n < MAX_COUNT for n in counts):
            return f"a {name} bucket count outside [0, 2**63)"
    if not 0.0 <= h.seconds_sum < float(MAX_COUNT):  # NaN fails too
        return f"seconds_sum={h.seconds_sum}"
    for name, total in (
        ("prefill_tokens", h.prefill_tokens_sum),
        ("decode_seqs", h.decode_seqs_sum),
    ):
        if not 0 <= total < MAX_COUNT:
            return f"{name}_sum={total}"
    return None
