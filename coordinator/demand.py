"""What a model's load asks of each pool, in workers, and of a decode worker's local prefills:
the planner's formulas (coordinator/planner.py applies margins, floors and hysteresis to them).
Pure functions of a ``Load``, the ``Targets`` and a ``Profile``: the profile at the size the
role's workers run at (``Load.prefill_tp``, ``Load.decode_tp``: a tensor-parallel group is one
worker, and its speed is its size's), which the planner picks.

λ arrivals/s, P mean prompt and O mean output tokens, p the profile, D decode workers, b the
batch a decode worker runs: the largest with p.step(b, P + O/2) within the TPOT target (within
2·p.step(1) where even one sequence misses it), and at most kv_per_worker / blocks(P + O) and
``max_batch``::

    prefill  λ·p.prefill(P) + queued_tokens · p.prefill(P)/P / ttft    busy + drain in TTFT
    decode   max(λ·O · p.step(b)/b,  (running + waiting)/b,  kv_used / kv_per_worker)
             (Little's law: λ·O·step sequences in flight, b a worker)
    no profile: prefill queued_tokens / queue_tokens_per_prefill; decode kv_used / kv_per_worker

The local-prefill threshold: a local prefill of n tokens stalls the decode batch p.prefill(n).
A stream lives about O·tpot seconds and meets at most max(1, λ/D·O·tpot) arrivals, whose
stalls, spread over its O tokens, must fit the TPOT target's slack over the current step::

    p.prefill(n) ≤ (tpot − p.step(running/D, P + O/2)) / max(1/O, λ/D · tpot)

one stall a stream (divisor 1/O) while the prefill pool is the bottleneck (its queue drains
slower than the TTFT target); and p.prefill(n) ≤ ttft: a stall is a gap in every stream of the
worker, never longer than a new request may wait for its first token. Whole blocks, at most
the longest prompt profiled and the cap; 0 without a profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from pdserve.coordinator.profile import Profile
from pdserve.protocol.blocks import blocks_for

# A TPOT target under one sequence's step is out of reach whatever the workers: a step may then
# take this many times one sequence's (more workers would spend cores, not meet the target).
OUT_OF_REACH_STEP = 2.0


@dataclass(frozen=True)
class Targets:
    """The SLOs, p90 seconds: time to first token, time per output token."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"target {name} must be a positive number, got {value}")


@dataclass(frozen=True)
class Load:
    """One model's live figures over the window (the coordinator fills it)."""

    arrival_rate: float  # requests (choices) per second arriving
    prompt_tokens: float  # mean prompt tokens per request (not cached)
    output_tokens: float  # mean generated tokens per finished choice
    prefill_queue_tokens: int  # prompt tokens queued on prefill workers now
    decode_running: int  # sequences running on decode workers now
    decode_waiting: int  # requests waiting for decode blocks (coordinator queue)
    kv_used_blocks: int
    kv_total_blocks: int  # decode pool
    ttft_p90_s: float | None  # from the gateways' samples over the window (None: no sample)
    tpot_p90_s: float | None
    prefill_workers: int  # live, not draining (each a tensor-parallel group of *_tp ranks)
    decode_workers: int
    # the tensor-parallel size of the role's workers (the one most of them run at; 1: none):
    # the size of the profile the role's figures are read from
    prefill_tp: int = 1
    decode_tp: int = 1


def prefill_demand(
    profile: Profile | None, targets: Targets, load: Load, queue_tokens_per_prefill: int
) -> tuple[str, float]:
    """Prefill workers the load keeps busy, and the signal that weighs most."""
    queued = load.prefill_queue_tokens
    if profile is None:
        return "queue", queued / queue_tokens_per_prefill
    per_token = _prefill_per_token(profile, load)
    arrivals = load.arrival_rate * load.prompt_tokens * per_token
    drain = queued * per_token / targets.ttft_s
    return ("arrivals" if arrivals >= drain else "queue"), arrivals + drain


def decode_demand(
    profile: Profile | None, targets: Targets, load: Load, max_batch: int
) -> tuple[str, float]:
    """Decode workers the load keeps busy, and the signal that weighs most."""
    per_worker = kv_per_worker(profile, load)
    terms = [("kv", load.kv_used_blocks / per_worker)] if per_worker else []
    if profile is not None:
        b, step = decode_batch(profile, targets, load, per_worker, max_batch)
        terms.append(("arrivals", load.arrival_rate * load.output_tokens * step / b))
        terms.append(("running", (load.decode_running + load.decode_waiting) / b))
    return max(terms, key=lambda term: term[1], default=("idle", 0.0))


def kv_per_worker(profile: Profile | None, load: Load) -> float | None:
    """KV blocks one decode worker holds: the live pool's mean, else the profile's."""
    if load.decode_workers > 0 and load.kv_total_blocks > 0:
        return load.kv_total_blocks / load.decode_workers
    return float(profile.kv_blocks) if profile is not None else None


def decode_batch(
    profile: Profile, targets: Targets, load: Load, per_worker: float | None, max_batch: int
) -> tuple[int, float]:
    """The batch a decode worker runs (TPOT- and KV-bound, at least 1) and its step seconds."""
    context = round(load.prompt_tokens + load.output_tokens / 2)
    limit = max_batch
    if per_worker is not None:
        per_seq = blocks_for(
            max(1, round(load.prompt_tokens + load.output_tokens)), profile.block_size
        )
        limit = max(1, min(limit, int(per_worker // per_seq)))
    longest = targets.tpot_s
    if not tpot_reachable(profile, targets, load):
        longest = OUT_OF_REACH_STEP * profile.decode_step_seconds(1, context)
    b = 1
    while b < limit and profile.decode_step_seconds(b + 1, context) <= longest:
        b += 1
    return b, profile.decode_step_seconds(b, context)


def tpot_reachable(profile: Profile | None, targets: Targets, load: Load) -> bool:
    """Whether one sequence's decode step is within the TPOT target (True without a profile:
    nothing says otherwise)."""
    if profile is None:
        return True
    context = round(load.prompt_tokens + load.output_tokens / 2)
    return profile.decode_step_seconds(1, context) <= targets.tpot_s


def local_prefill_threshold(
    profile: Profile | None,
    targets: Targets,
    load: Load,
    cap: int,
    prefill_profile: Profile | None = None,
) -> int:
    """The longest prompt (tokens, whole blocks, at most ``cap``) a decode worker may prefill
    itself. ``profile``: the decode workers' (the prefill runs on one, at its size);
    ``prefill_profile``: the prefill pool's, which says whether its queue is the bottleneck
    (None: ``profile``'s prefill speed stands in for the pool's)."""
    if profile is None:
        return 0
    workers = max(1, load.decode_workers)
    batch = max(1, math.ceil(load.decode_running / workers))
    step = profile.decode_step_seconds(batch, round(load.prompt_tokens + load.output_tokens / 2))
    slack = targets.tpot_s - step
    if slack <= 0:
        return 0
    per_token_share = 1 / load.output_tokens if load.output_tokens >= 1 else 1.0
    stalls = max(per_token_share, load.arrival_rate / workers * targets.tpot_s)
    if _prefill_bottleneck(prefill_profile or profile, targets, load):
        stalls = per_token_share
    # spread over a stream's tokens a long stall still meets a mean TPOT; but no stream may
    # wait longer between two tokens than a new one may wait for its first
    budget = min(slack / stalls, targets.ttft_s)
    low, high = 0, min(cap, profile.prefill[-1][0])  # the largest n within the budget
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if profile.prefill_seconds(mid) <= budget else (low, mid - 1)
    return low // profile.block_size * profile.block_size


def _prefill_bottleneck(profile: Profile, targets: Targets, load: Load) -> bool:
    """The prefill queue takes longer than the TTFT target to drain."""
    per_worker = load.prefill_queue_tokens / max(1, load.prefill_workers)
    return per_worker * _prefill_per_token(profile, load) > targets.ttft_s


def _prefill_per_token(profile: Profile, load: Load) -> float:
    """Prefill seconds a prompt token at the mean prompt length."""
    n = max(1, round(load.prompt_tokens))
    return profile.prefill_seconds(n) / n


def clean_load(load: Load) -> Load:
    """``load`` with every figure finite and non-negative (NaN, inf, negatives: 0; a p90 that
    is not a number: None; a tensor-parallel size under 1: 1)."""
    changes: dict[str, Any] = {}
    for f in fields(load):
        value = getattr(load, f.name)
        if value is None:
            continue
        if f.name.endswith("_tp"):
            if not value >= 1:
                changes[f.name] = 1
            continue
        ok = math.isfinite(value) and value >= 0
        if not ok:
            changes[f.name] = None if f.name.endswith("_p90_s") else type(value)(0)
    return replace(load, **changes) if changes else load
