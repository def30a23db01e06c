"""What a simulated run measured, with the bench's definitions (bench/metrics.py): TTFT from
arrival to token 0 at the gateway, TPOT = (last token − token 0) / (tokens − 1) for requests
of two tokens or more, ITL the gaps between a stream's tokens (recorded only when asked), goodput
= requests that met every SLO / the run's duration (first arrival to last token)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdserve.sim.request import SimRequest

PERCENTILES = (50, 90, 99)


@dataclass
class Outcome:
    """One request's fate: times are seconds from the start of the run."""

    req: SimRequest
    t_first: float | None = None  # token 0 at the gateway
    t_last: float | None = None  # its last token at the gateway
    tokens: int = 0  # output tokens the gateway got
    failed: str = ""  # why it failed ("" if it did not)
    local: bool = False  # prefilled where it decodes (colocated or conditional)
    computed: int = 0  # prompt tokens computed (a prefix cache hit is not)
    preempted: int = 0  # times its decode worker preempted it
    gaps: list[float] | None = None  # seconds between its tokens (when recorded)

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.req.arrival_s

    @property
    def tpot(self) -> float | None:
        if self.t_first is None or self.t_last is None or self.tokens < 2:
            return None
        return (self.t_last - self.t_first) / (self.tokens - 1)

    @property
    def done(self) -> bool:
        return not self.failed and self.tokens >= self.req.output_tokens


@dataclass(frozen=True)
class Slo:
    """Seconds; a request meets the SLO when its TTFT and its TPOT are within them."""

    ttft_s: float = math.inf
    tpot_s: float = math.inf

    def met(self, o: Outcome) -> bool:
        ttft, tpot = o.ttft, o.tpot
        return (
            o.done
            and ttft is not None
            and ttft <= self.ttft_s
            and (tpot is None or tpot <= self.tpot_s)
        )


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile of ``values`` (not empty)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    outcomes: Iterable[Outcome], slo: Slo = Slo(), kinds: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Figures over ``outcomes`` (of ``kinds`` only when given): ``completed``, ``failed``,
    ``{stat}_{ttft,tpot,itl}_ms`` for mean/p50/p90/p99/max, ``request_goodput``,
    ``slo_attainment``, ``output_throughput``, ``duration``."""
    chosen = [o for o in outcomes if not kinds or o.req.kind in kinds]
    done = [o for o in chosen if o.done]
    result: dict[str, Any] = {
        "requests": len(chosen),
        "completed": len(done),
        "failed": sum(1 for o in chosen if o.failed),
    }
    if not chosen:
        return result
    start = min(o.req.arrival_s for o in chosen)
    end = max((o.t_last or 0.0) for o in chosen) if done else start
    duration = max(end - start, 1e-9)
    good = sum(1 for o in chosen if slo.met(o))
    result.update(
        duration=duration,
        request_throughput=len(done) / duration,
        request_goodput=good / duration,
        slo_attainment=good / len(chosen),
        output_throughput=sum(o.tokens for o in done) / duration,
    )
    series = {
        "ttft": [o.ttft for o in done if o.ttft is not None],
        "tpot": [o.tpot for o in done if o.tpot is not None],
        "itl": [g for o in done if o.gaps for g in o.gaps],
    }
    for name, values in series.items():
        if not values:
            continue
        ms = [v * 1e3 for v in values]
        result[f"mean_{name}_ms"] = sum(ms) / len(ms)
        for q in PERCENTILES:
            result[f"p{q}_{name}_ms"] = percentile(ms, q)
        result[f"median_{name}_ms"] = result[f"p50_{name}_ms"]
        result[f"max_{name}_ms"] = max(ms)
    return result
