"""A measured profile brought to a host's speed on another day: two scalars, one for prefill
seconds and one for decode seconds, read off a real run's own step counters.

The host's speed varies between days (a lone GGUF decode step of SmolLM2 took 40 ms one day,
12.6 ms another), so a profile measured today predicts an older run only once scaled. The
counters are a worker's ``/metrics`` totals by step kind (bench/experiments/disagg_vs_colocated's
``worker_steps``): ``decode:seconds_sum``, ``decode:seconds_count``, ``decode:decode_seqs_sum``,
``prefill:prefill_tokens_sum``, ``mixed:...``. Each kind's mean step is set beside the
profile's answer at its mean size, summed over steps (seconds weigh, not workers)::

    decode   d = Σ decode:seconds_sum / Σ count · D(mean batch, context)
    prefill  p = Σ prompt seconds / Σ count · P(mean tokens), over prefill-only steps and
             mixed ones, a mixed step's prompt seconds its time net of its decodes
             (StepTimes.mixed: d·D(b) + p·P(n) − d·D(1, 0), a chunk dearer than a lone step)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from pdserve.coordinator.profile import Profile

Counters = Mapping[str, float]


def scale_profile(profile: Profile, prefill: float = 1.0, decode: float = 1.0) -> Profile:
    """``profile`` with every prefill time × ``prefill`` and every decode step × ``decode``."""
    for name, value in (("prefill", prefill), ("decode", decode)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} scale must be a positive number, got {value!r}")
    note = f"host-scaled {profile.device} profile: prefill x{prefill:.3f}, decode x{decode:.3f}"
    return dataclasses.replace(
        profile,
        prefill=tuple((n, t * prefill) for n, t in profile.prefill),
        decode=tuple((b, c, t * decode) for b, c, t in profile.decode),
        derived=f"{profile.derived}; {note}" if profile.derived else note,
    )


def decode_at(profile: Profile, batch: float, context: int) -> float:
    """``profile``'s decode step at a fractional (mean) ``batch``: linear between the two
    whole batches around it."""
    lo = max(1, math.floor(batch))
    t_lo = profile.decode_step_seconds(lo, context)
    if batch <= lo:
        return t_lo
    t_hi = profile.decode_step_seconds(lo + 1, context)
    return t_lo + (t_hi - t_lo) * (batch - lo)


def prefill_at(profile: Profile, tokens: float) -> float:
    """``profile``'s prefill of a fractional (mean) number of ``tokens``."""
    lo = max(1, math.floor(tokens))
    t_lo = profile.prefill_seconds(lo)
    if tokens <= lo:
        return t_lo
    return t_lo + (profile.prefill_seconds(lo + 1) - t_lo) * (tokens - lo)


def _kind(w: Counters, kind: str) -> tuple[float, float, float, float]:
    """(steps, seconds, prompt tokens, decode sequences) of one worker's ``kind`` steps."""
    return (
        w.get(f"{kind}:seconds_count", 0.0),
        w.get(f"{kind}:seconds_sum", 0.0),
        w.get(f"{kind}:prefill_tokens_sum", 0.0),
        w.get(f"{kind}:decode_seqs_sum", 0.0),
    )


def decode_scale(workers: Iterable[Counters], profile: Profile, context: int) -> float:
    """Observed decode-only seconds over the profile's at each worker's mean batch."""
    seen = predicted = 0.0
    for w in workers:
        steps, seconds, _, seqs = _kind(w, "decode")
        if steps > 0:
            seen += seconds
            predicted += steps * decode_at(profile, seqs / steps, context)
    if predicted <= 0:
        raise ValueError("no decode-only steps in the counters: no decode scale")
    return seen / predicted


def prefill_scale(
    workers: Iterable[Counters], profile: Profile, decode: float, context: int
) -> float:
    """Observed prompt seconds over the profile's: prefill-only steps whole, mixed steps
    past their decodes (at decode scale ``decode``)."""
    lone = profile.decode_step_seconds(1, 0)
    seen = predicted = 0.0
    for w in workers:
        for kind in ("prefill", "mixed"):
            steps, seconds, n, seqs = _kind(w, kind)
            if steps <= 0 or n <= 0:
                continue
            if kind == "mixed":
                seconds -= steps * decode * (decode_at(profile, seqs / steps, context) - lone)
            seen += seconds
            predicted += steps * prefill_at(profile, n / steps)
    if seen <= 0 or predicted <= 0:
        raise ValueError("no steps with prompt tokens in the counters: no prefill scale")
    return seen / predicted


def host_scales(
    workers: Iterable[Counters], profile: Profile, context: int = 128
) -> tuple[float, float]:
    """(prefill, decode) scales of ``profile`` that the step counters of ``workers`` (one
    mapping per worker and run) say; ``context``: a typical decode context, tokens."""
    workers = list(workers)
    decode = decode_scale(workers, profile, context)
    return prefill_scale(workers, profile, decode, context), decode
