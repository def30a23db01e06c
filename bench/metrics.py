"""Per-request timings and the summary metrics, defined as vLLM's serving benchmark
(``benchmark_serving.py``, ``vllm bench serve``) defines them::

    start ──────── first chunk with choices ── chunk ── chunk ── … ── last chunk with choices
      │◀──── TTFT ────▶│◀── ITL ──▶│◀─ ITL ─▶│                                  │
      │◀─────────────────────────────── E2EL ──────────────────────────────────▶│

    TPOT = (E2EL − TTFT) / (output tokens − 1), for outputs of more than one token

Output tokens come from the stream's ``usage``. ITLs are pooled over every request. Goodput
counts completed requests meeting every SLO (a one-token output's TPOT counts as 0, as in vLLM)
per second of the run; attainment is their share of all requests sent, failed ones included.

A multi-turn run adds ``per_turn``: the same figures for each turn index, and for turns 3 and
later pooled (``"3+"``), with the sum of the server's ``prompt_tokens_details.cached_tokens``
(``None`` where the server reported none).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any  # a result is JSON: figures, lists and maps, read by key

import numpy as np

METRICS = ("ttft", "ttft_content", "tpot", "itl", "e2el")
TURN_METRICS = ("ttft", "tpot", "e2el")
POOLED_FROM_TURN = 3  # the aims are stated at turns >= 3


@dataclass
class RequestOutput:
    """What one request measured; times in seconds."""

    success: bool = False
    error: str = ""
    start_time: float = 0.0  # since the run began
    ttft: float = 0.0  # to the first chunk carrying choices
    ttft_content: float | None = None  # to the first chunk with non-empty text
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL: to the last chunk carrying choices
    output_tokens: int = 0
    prompt_tokens: int = 0  # the server's usage, else the workload's own count
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    generated_text: str = ""
    kind: str = ""
    turn: int = 0  # a multi-turn conversation's turn, from 1; 0: not one

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; ``None`` means not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def parse_slo(items: list[str] | None) -> Slo:
    """``["ttft:500", "tpot:50"]`` → ``Slo(ttft_ms=500.0, tpot_ms=50.0)``."""
    values: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad SLO {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            values[f"{name}_ms"] = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {item!r}: {value!r} is not a number of ms") from None
        if values[f"{name}_ms"] <= 0:
            raise ValueError(f"bad SLO {item!r}: must be positive")
    return Slo(**values)


def meets_slo(out: RequestOutput, slo: Slo) -> bool:
    if not out.success:
        return False
    checks = (
        (slo.ttft_ms, out.ttft),
        (slo.tpot_ms, out.tpot or 0.0),
        (slo.e2el_ms, out.latency),
    )
    return all(limit is None or value <= limit / 1000 for limit, value in checks)


def metric_values(outputs: list[RequestOutput], metric: str) -> list[float]:
    """Seconds of one metric over completed requests (ITL pooled over all of them)."""
    done = [o for o in outputs if o.success]
    if metric == "itl":
        return [gap for o in done for gap in o.itl]
    if metric == "tpot":
        return [o.tpot for o in done if o.tpot is not None]
    if metric == "ttft_content":
        return [o.ttft_content for o in done if o.ttft_content is not None]
    return [getattr(o, "latency" if metric == "e2el" else metric) for o in done]


def percentile_key(p: float) -> str:
    """vLLM's key word for a percentile: 99 → ``p99``, 99.9 → ``p99.9``."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def distribution(values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean, median, std, the percentiles and max, in ms; all 0 for no values (as vLLM)."""
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000
    out = {
        "mean": float(np.mean(ms)),
        "median": float(np.median(ms)),
        "std": float(np.std(ms)),
    }
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(ms, p))
    out["max"] = float(np.max(ms))
    return out


def summarize(
    outputs: list[RequestOutput],
    duration_s: float,
    slo: Slo | None = None,
    percentiles: tuple[float, ...] = (90, 99),
) -> dict[str, Any]:
    """The aggregate result, under vLLM's keys (plus ``ttft_content``, ``max_*``, SLO fields)."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_tokens for o in done)
    total_output = sum(o.output_tokens for o in done)
    good = sum(meets_slo(o, slo) for o in done) if slo and slo.active else None
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "good_requests": good,
        "slo_attainment": None if good is None or not outputs else good / len(outputs),
        "total_cached_tokens": cached_sum(done),
        "error_summary": dict(Counter(o.error for o in outputs if not o.success)),
    }
    for metric in METRICS:
        for stat, value in distribution(metric_values(outputs, metric), percentiles).items():
            result[f"{stat}_{metric}_ms"] = value
    return result


def detail(outputs: list[RequestOutput]) -> dict[str, list[Any]]:
    """Per-request lists, under vLLM's ``--save-detailed`` keys (plus ours)."""
    return {
        "input_lens": [o.prompt_tokens for o in outputs],
        "output_lens": [o.output_tokens if o.success else 0 for o in outputs],
        "ttfts": [o.ttft if o.success else None for o in outputs],
        "ttft_contents": [o.ttft_content if o.success else None for o in outputs],
        "tpots": [o.tpot for o in outputs],
        "itls": [o.itl for o in outputs],
        "e2els": [o.latency if o.success else None for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "kinds": [o.kind for o in outputs],
        "turns": [o.turn for o in outputs],
        "cached_tokens": [o.cached_tokens for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }


def cached_sum(outputs: list[RequestOutput]) -> int | None:
    """The server's cached prompt tokens over ``outputs``; None if it reported none."""
    reported = [o.cached_tokens for o in outputs if o.cached_tokens is not None]
    return sum(reported) if reported else None


def per_turn(
    outputs: list[RequestOutput], turns: int, percentiles: tuple[float, ...] = (90, 99)
) -> dict[str, dict[str, Any]]:
    """``{"1": stats, …, str(turns): stats, "3+": stats}`` ("3+" when there are 3 turns or
    more): requests sent, completed, prompt and cached tokens of the completed ones, and the
    distribution of each of ``TURN_METRICS`` in ms."""
    buckets = {str(t): [o for o in outputs if o.turn == t] for t in range(1, turns + 1)}
    if turns >= POOLED_FROM_TURN:
        buckets[f"{POOLED_FROM_TURN}+"] = [o for o in outputs if o.turn >= POOLED_FROM_TURN]
    result = {}
    for label, outs in buckets.items():
        done = [o for o in outs if o.success]
        stats: dict[str, Any] = {
            "requests": len(outs),
            "completed": len(done),
            "prompt_tokens": sum(o.prompt_tokens for o in done),
            "cached_tokens": cached_sum(done),
        }
        for metric in TURN_METRICS:
            for stat, value in distribution(metric_values(outs, metric), percentiles).items():
                stats[f"{stat}_{metric}_ms"] = value
        result[label] = stats
    return result
