"""What the planner hears and says on the wire: each gateway's latency samples (in its
``GatewayHello``) and the coordinator's plan per model (in ``ClusterState``).

A gateway measures time to first token and time per output token; the coordinator, which
sees every gateway's requests, pools them over its window and compares them with the SLOs.
Sample lists are bounded here (``MAX_SAMPLES``) and every value is checked by the coordinator
before use (``samples_problem``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_SAMPLES = 1024  # per list and hello: a gateway sends at most this many, the rest wait
MAX_SECONDS = 86_400.0
MAX_OUTPUT_TOKENS = 1 << 24


@dataclass(frozen=True, kw_only=True)
class LatencySamples:
    """One model's requests that a gateway saw end since its last hello."""

    model: str
    ttft_s: list[float] = field(default_factory=list)  # time to first token, each request
    tpot_s: list[float] = field(default_factory=list)  # time per output token after the first
    output_tokens: list[int] = field(default_factory=list)  # tokens of each finished choice
    # requests that ended (whatever the outcome, refusals before they ran too) and of those the
    # ones that failed (an error, a timeout, a 5xx): the canary gate's error rates
    requests: int = 0
    errors: int = 0


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """The planner's latest word on one model: the workers it wants per role, the largest
    prompt a decode worker prefills itself, why, and the figures it read (``load``: the
    planner's ``Load`` by field, None where there was no sample)."""

    model: str
    prefill: int
    decode: int
    max_local_prefill_tokens: int
    reason: str
    load: dict[str, float | None] = field(default_factory=dict)


def samples_problem(s: LatencySamples) -> str | None:
    """Why ``s`` cannot be a gateway's measurements, or None."""
    lists = (("ttft_s", s.ttft_s), ("tpot_s", s.tpot_s), ("output_tokens", s.output_tokens))
    for name, values in lists:
        if len(values) > MAX_SAMPLES:
            return f"{len(values)} {name} samples (at most {MAX_SAMPLES})"
    for name, seconds in (("ttft_s", s.ttft_s), ("tpot_s", s.tpot_s)):
        if any(not (math.isfinite(x) and 0.0 <= x <= MAX_SECONDS) for x in seconds):
            return f"a {name} sample outside [0, {MAX_SECONDS:.0f}] s"
    if any(not 0 <= n <= MAX_OUTPUT_TOKENS for n in s.output_tokens):
        return f"an output_tokens sample outside [0, {MAX_OUTPUT_TOKENS}]"
    if not 0 <= s.errors <= s.requests <= MAX_OUTPUT_TOKENS:
        return f"{s.errors} errors of {s.requests} requests"
    return None
