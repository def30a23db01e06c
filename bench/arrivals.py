"""When each request is sent: gaps drawn from a gamma distribution of shape ``burstiness``
and mean ``1 / rate`` (shape 1 is a Poisson process; below 1 burstier, above 1 steadier), as in
vLLM. ``rate = inf`` sends everything at once. The first request goes at t = 0."""

from __future__ import annotations

import math

import numpy as np

from pdserve.bench.datasets import BenchRequest


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be positive or inf, got {text!r}")
    return rate


def arrival_offsets(
    n: int, rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Send times in seconds from the start, non-decreasing."""
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def schedule(
    requests: list[BenchRequest], rate: float, burstiness: float, rng: np.random.Generator
) -> list[tuple[float, BenchRequest]]:
    """(send time, request), in time order: requests without a fixed ``at`` follow the
    arrival process in list order; fixed ones (a mixed workload's bursts) keep their time."""
    free = [r for r in requests if r.at is None]
    timed = list(zip(arrival_offsets(len(free), rate, burstiness, rng), free, strict=True))
    timed += [(r.at, r) for r in requests if r.at is not None]
    return sorted(timed, key=lambda pair: pair[0])
