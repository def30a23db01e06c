"""Rate sweeps: a list of rates, or ``--sweep`` (synchronous, then max throughput, then rates
evenly between the two), and the highest rate whose SLO attainment is at least 90% (DistServe's
definition of goodput)."""

from __future__ import annotations

import math
from typing import Any  # result rows are JSON: values of every type, read by key

import numpy as np

from pdserve.bench.arrivals import parse_rate

ATTAINMENT_TARGET = 0.9


def parse_rates(text: str) -> list[float]:
    """``"1,2,4,8"`` → ``[1.0, 2.0, 4.0, 8.0]``; ``"inf"`` → ``[inf]``."""
    try:
        return [parse_rate(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise ValueError(f"bad --request-rate {text!r}: {e}") from None


def rates_between(sync_rate: float, max_rate: float, points: int) -> list[float]:
    """``points`` rates strictly between the synchronous and the max-throughput rate."""
    if points < 1 or not max_rate > sync_rate:
        return []
    return [round(r, 3) for r in np.linspace(sync_rate, max_rate, points + 2)[1:-1].tolist()]


def effective_rate(offered: float, result: dict[str, Any]) -> float:
    """The offered rate, or what was achieved where the offer was unbounded."""
    return offered if math.isfinite(offered) else result["request_throughput"]


def best_rate(rows: list[dict[str, Any]], target: float = ATTAINMENT_TARGET) -> float | None:
    """The highest ``rate`` among rows meeting the SLO for at least ``target`` of requests."""
    attained = [r["rate"] for r in rows if (r.get("slo_attainment") or 0.0) >= target]
    return max(attained, default=None)
