"""What a person sees: a progress bar with live figures during a run, then the result table;
for sweeps one row per rate as each finishes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO  # a result is JSON: values of every type, read by key

from pdserve.bench.metrics import RequestOutput

ROWS = (
    ("TTFT", "ttft"),
    ("TTFT content", "ttft_content"),
    ("TPOT", "tpot"),
    ("ITL", "itl"),
    ("E2EL", "e2el"),
)
SWEEP_COLUMNS = (
    ("stage", "sweep_stage", "{}"),
    ("rate", "request_rate", "{:.2f}"),
    ("done", "completed", "{}"),
    ("fail", "failed", "{}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("tok/s", "output_throughput", "{:.1f}"),
    ("goodput", "request_goodput", "{:.2f}"),
    ("attain%", "slo_attainment", "{:.1%}"),
    ("p99 TTFT", "p99_ttft_ms", "{:.1f}"),
    ("p99 TPOT", "p99_tpot_ms", "{:.1f}"),
    ("p99 ITL", "p99_itl_ms", "{:.1f}"),
)


class Progress:
    """``[#####.....] 50/100 fail 0 run 8 12.3s | TTFT p50 80ms TPOT p50 21ms``, redrawn in
    place on a terminal, a line every 10 s elsewhere."""

    def __init__(self, label: str = "", stream: TextIO | None = None, width: int = 24) -> None:
        self.label, self.stream, self.width = label, stream or sys.stderr, width
        self.tty = self.stream.isatty()
        self.total = self.done = self.failed = 0
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.t0 = 0.0
        self._ticker: asyncio.Task[None] | None = None

    def start(self, t0: float, total: int) -> None:
        self.t0, self.total = t0, total
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def finished(self, out: RequestOutput) -> None:
        self.done += 1
        if out.success:
            self.ttfts.append(out.ttft)
            if out.tpot is not None:
                self.tpots.append(out.tpot)
        else:
            self.failed += 1

    def all_sent(self, sent: int) -> None:
        self.total = sent

    def line(self, now: float) -> str:
        frac = self.done / self.total if self.total else 0.0
        bar = "#" * round(frac * self.width) + "." * (self.width - round(frac * self.width))
        text = f"{self.label}[{bar}] {self.done}/{self.total} fail {self.failed}"
        text += f" {now - self.t0:6.1f}s"
        if self.ttfts:
            text += f" | TTFT p50 {statistics.median(self.ttfts) * 1000:.0f}ms"
        if self.tpots:
            text += f" TPOT p50 {statistics.median(self.tpots) * 1000:.1f}ms"
        return text

    async def _tick(self) -> None:
        period = 0.5 if self.tty else 10.0
        while True:
            await asyncio.sleep(period)
            self._draw()

    def _draw(self, final: bool = False) -> None:
        text = self.line(time.perf_counter())
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else "\x1b[K"))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._ticker:
            self._ticker.cancel()
            self._ticker = None
        self._draw(final=True)


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    with contextlib.suppress(ValueError, TypeError):
        return spec.format(value)
    return str(value)


def result_table(result: dict[str, Any], percentiles: tuple[float, ...]) -> str:
    """vLLM's summary lines, then one row per latency metric."""
    lines = ["{:=^64}".format(" Serving Benchmark Result ")]
    facts = [
        ("Successful requests", result["completed"], "{}"),
        ("Failed requests", result["failed"], "{}"),
        ("Benchmark duration (s)", result["duration"], "{:.2f}"),
        ("Total input tokens", result["total_input_tokens"], "{}"),
        ("Total generated tokens", result["total_output_tokens"], "{}"),
        ("Request throughput (req/s)", result["request_throughput"], "{:.2f}"),
        ("Request goodput (req/s)", result["request_goodput"], "{:.2f}"),
        ("SLO attainment", result["slo_attainment"], "{:.1%}"),
        ("Output token throughput (tok/s)", result["output_throughput"], "{:.2f}"),
        ("Total token throughput (tok/s)", result["total_token_throughput"], "{:.2f}"),
    ]
    lines += [f"{name + ':':<40} {_fmt(v, spec)}" for name, v, spec in facts]
    stats = ["mean", "median", *[f"p{p:g}" for p in percentiles], "max"]
    lines.append(f"{'(ms)':<14}" + "".join(f"{s:>10}" for s in stats))
    for title, metric in ROWS:
        keys = [f"{s}_{metric}_ms" for s in stats]
        lines.append(f"{title:<14}" + "".join(f"{result.get(k, 0.0):>10.2f}" for k in keys))
    if result.get("per_turn"):
        lines += turn_rows(result["per_turn"], percentiles[-1] if percentiles else 99)
    for error, count in list(result.get("error_summary", {}).items())[:5]:
        lines.append(f"failed x{count}: {error[:200]}")
    lines.append("=" * 64)
    return "\n".join(lines)


def turn_rows(per_turn: dict[str, dict[str, Any]], p: float) -> list[str]:
    """A multi-turn run's figures by turn: requests, tokens, median and ``p`` TTFT and TPOT."""
    pk = f"p{p:g}"
    figures = ("prompt", "cached", "TTFT p50", f"TTFT {pk}", "TPOT p50", f"TPOT {pk}")
    lines = ["{:-^64}".format(" By turn (tokens summed, ms) ")]
    lines.append(f"{'turn':<5}{'done':>5}{'fail':>5}" + "".join(f"{h:>9}" for h in figures))
    for label, s in per_turn.items():
        row = f"{label:<5}{s['completed']:>5}{s['requests'] - s['completed']:>5}"
        row += f"{s['prompt_tokens']:>9}{_fmt(s['cached_tokens'], '{}'):>9}"
        keys = ("median_ttft_ms", f"{pk}_ttft_ms", "median_tpot_ms", f"{pk}_tpot_ms")
        lines.append(row + "".join(f"{s.get(k, 0.0):>9.1f}" for k in keys))
    return lines


def sweep_header() -> str:
    return "".join(f"{title:>10}" for title, _, _ in SWEEP_COLUMNS)


def sweep_row(result: dict[str, Any]) -> str:
    return "".join(f"{_fmt(result.get(key), spec):>10}" for _, key, spec in SWEEP_COLUMNS)


def save_json(path: str | Path, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")
