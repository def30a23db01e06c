"""What the engine's steps were: per kind of step (decode only, mixed, prefill only), histograms
of their time, prompt tokens and decode sequences, and the steps carrying decodes that ran over
the TPOT target, by reason. A worker reports it in its heartbeat (``StepCounters``), the
gateway shows it in ``/metrics``::

    pdserve_worker_step_seconds{kind="mixed"}         how long steps took
    pdserve_worker_step_prefill_tokens{kind="mixed"}  prompt tokens a step computed
    pdserve_worker_step_decode_seqs{kind="decode"}    streams a step advanced
    pdserve_worker_steps_over_target_total{reason}    decode-carrying steps over the target

An operator reads the reason off them: slow ``decode`` steps are too many streams for the
target; slow ``mixed`` ones with reason ``age_bound`` are prompts that went the age bound
without a token (the target left them no room) let through a block at a time;
``misprediction`` is the step-time model (or a busy machine) being off.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from pdserve.protocol.control import (
    OVER_TARGET_REASONS,
    STEP_DECODE_SEQS_BUCKETS,
    STEP_KINDS,
    STEP_PREFILL_TOKENS_BUCKETS,
    STEP_SECONDS_BUCKETS,
    StepCounters,
    StepHistogram,
)


class _Histogram:
    """Counts per bucket (one per bound, value <= bound, and one past the last) and the sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum: float = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _KindStats:
    def __init__(self) -> None:
        self.seconds = _Histogram(STEP_SECONDS_BUCKETS)
        self.prefill_tokens = _Histogram(STEP_PREFILL_TOKENS_BUCKETS)
        self.decode_seqs = _Histogram(STEP_DECODE_SEQS_BUCKETS)

    def counters(self) -> StepHistogram:
        return StepHistogram(
            seconds_counts=list(self.seconds.counts),
            seconds_sum=float(self.seconds.sum),
            prefill_tokens_counts=list(self.prefill_tokens.counts),
            prefill_tokens_sum=int(self.prefill_tokens.sum),
            decode_seqs_counts=list(self.decode_seqs.counts),
            decode_seqs_sum=int(self.decode_seqs.sum),
        )


def step_kind(prefill_tokens: int, decode_seqs: int) -> str:
    """``decode``, ``mixed`` or ``prefill`` (``STEP_KINDS``) for a step that ran."""
    if not decode_seqs:
        return "prefill"
    return "mixed" if prefill_tokens else "decode"


class StepStats:
    """The engine's steps since start (one writer: the engine's thread)."""

    def __init__(self) -> None:
        self._kinds: dict[str, _KindStats] = {}
        self.over_target = dict.fromkeys(OVER_TARGET_REASONS, 0)

    def record(
        self, prefill_tokens: int, decode_seqs: int, seconds: float, over_target: str | None
    ) -> None:
        """One step that ran; ``over_target``: why it ran over the TPOT target (an
        ``OVER_TARGET_REASONS``), None when it did not or there is none."""
        kind = step_kind(prefill_tokens, decode_seqs)
        stats = self._kinds.get(kind)
        if stats is None:
            stats = self._kinds[kind] = _KindStats()
        stats.seconds.observe(max(seconds, 0.0))
        stats.prefill_tokens.observe(prefill_tokens)
        stats.decode_seqs.observe(decode_seqs)
        if over_target is not None:
            self.over_target[over_target] += 1

    def steps(self, kind: str) -> int:
        """Steps of ``kind`` recorded so far."""
        stats = self._kinds.get(kind)
        return sum(stats.seconds.counts) if stats else 0

    def counters(self, tpot_target_s: float, model: Sequence[float]) -> StepCounters:
        """The wire form, with the target and step-time model (seconds) steps are sized by."""
        return StepCounters(
            tpot_target_s=tpot_target_s,
            model=[float(x) for x in model],
            by_kind={k: self._kinds[k].counters() for k in STEP_KINDS if k in self._kinds},
            over_target={r: n for r, n in self.over_target.items() if n},
        )
