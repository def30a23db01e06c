"""The speculation benchmark's report (``spec_speed.py``): medians over rounds, ratios against
no speculation side by side, the issue's aims, the markdown tables."""

from __future__ import annotations

import re
import shlex
import statistics
import subprocess
from typing import Any  # rounds and the report are JSON

from pdserve.bench.experiments.spec_workloads import requests_per_stream

WORKLOADS = ("copy", "chat")
AIM_COPY_SPEEDUP, AIM_SLOWDOWN, AIM_THROUGHPUT = 1.8, 1.05, 0.95

# ---- the report ------------------------------------------------------------------------------


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": values,
    }


MEDIANS = (
    "tpot_ms",
    "ttft_ms",
    "tokens_per_s",
    "acceptance",
    "speculated_share",
    "mean_step_ms",
    "mean_output_tokens",
)


def summarize(runs: list[dict[str, Any]], arms: list[str], streams: list[int]) -> dict[str, Any]:
    """``{workload: {streams: {arm: medians over rounds, and ratios against off}}}``."""
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        for c in streams:
            rows = {
                a: sorted(
                    (r for r in runs if (r["arm"], r["workload"], r["streams"]) == (a, w, c)),
                    key=lambda r: int(r["round"]),
                )
                for a in arms
            }
            for a, rs in rows.items():
                fig: dict[str, Any] = {k: median_of(rs, k) for k in MEDIANS}
                fig["failed"] = sum(int(r["failed"]) for r in rs)
                drafted = [sum(col) for col in zip(*(r["drafted"] for r in rs), strict=False)]
                accepted = [sum(col) for col in zip(*(r["accepted"] for r in rs), strict=False)]
                fig["position_acceptance"] = [
                    a_ / d if d else None for a_, d in zip(accepted, drafted, strict=True)
                ]
                pairs = list(zip(rows.get("off", []), rs, strict=False)) if a != "off" else []
                if pairs and all(o["tpot_ms"] and x["tpot_ms"] for o, x in pairs):
                    fig["tpot_speedup"] = spread([o["tpot_ms"] / x["tpot_ms"] for o, x in pairs])
                if pairs and all(o["tokens_per_s"] for o, _ in pairs):
                    fig["tps_ratio"] = spread(
                        [x["tokens_per_s"] / o["tokens_per_s"] for o, x in pairs]
                    )
                out.setdefault(w, {}).setdefault(str(c), {})[a] = fig
    return out


def aims(summary: dict[str, Any], streams: list[int]) -> list[tuple[str, str, str]]:
    """(aim, PASS | MISS | n/a, the figures) for the issue's three aims."""
    out: list[tuple[str, str, str]] = []
    one = summary.get("copy", {}).get("1", {}).get("ngram", {}).get("tpot_speedup")
    aim = f"copy, 1 stream, ngram: TPOT >= {AIM_COPY_SPEEDUP}x lower than off"
    if one is None:
        out.append((aim, "n/a", "not measured (needs arms off and ngram, streams 1)"))
    else:
        ok = one["median"] >= AIM_COPY_SPEEDUP
        out.append(
            (
                aim,
                "PASS" if ok else "MISS",
                f"{one['median']:.2f}x ({one['min']:.2f}-{one['max']:.2f})",
            )
        )
    slow = [
        (f"{a} at {c}", 1 / f["tpot_speedup"]["median"])
        for c, by_arm in summary.get("chat", {}).items()
        for a, f in by_arm.items()
        if "tpot_speedup" in f
    ]
    aim = f"chat: no arm's TPOT more than {AIM_SLOWDOWN - 1:.0%} above off's at any concurrency"
    figures = ", ".join(f"{name}: {ratio:.2f}x off's" for name, ratio in slow)
    ok = all(ratio <= AIM_SLOWDOWN for _, ratio in slow)
    out.append((aim, "n/a" if not slow else "PASS" if ok else "MISS", figures or "not measured"))
    top = max(streams)
    ratios = [
        (f"{w} {a}", f["tps_ratio"]["median"])
        for w in WORKLOADS
        for a, f in summary.get(w, {}).get(str(top), {}).items()
        if "tps_ratio" in f
    ]
    aim = f"{top} streams: tokens/s within {1 - AIM_THROUGHPUT:.0%} of off's (or above)"
    if top != 32:
        aim += " (the aim is at 32 streams)"
    figures = ", ".join(f"{name}: {ratio:.2f}x" for name, ratio in ratios)
    ok = all(ratio >= AIM_THROUGHPUT for _, ratio in ratios)
    out.append((aim, "n/a" if not ratios else "PASS" if ok else "MISS", figures or "not measured"))
    return out


def fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def ratio_cell(s: dict[str, Any] | None) -> str:
    return "-" if s is None else f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"


def tables(summary: dict[str, Any]) -> str:
    lines: list[str] = []
    for w, by_streams in summary.items():
        lines += [
            f"### {w}",
            "",
            "| streams | arm | TPOT ms | TTFT ms | tokens/s | out tokens | acceptance "
            "| by position | speculated | step ms | TPOT off/arm | tokens/s arm/off | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c, by_arm in by_streams.items():
            for a, f in by_arm.items():
                positions = "/".join(fmt(p, "{:.2f}") for p in f["position_acceptance"]) or "-"
                cells = [
                    c,
                    a,
                    fmt(f["tpot_ms"], "{:.1f}"),
                    fmt(f["ttft_ms"], "{:.0f}"),
                    fmt(f["tokens_per_s"], "{:.1f}"),
                    fmt(f["mean_output_tokens"], "{:.0f}"),
                    fmt(f["acceptance"], "{:.0%}"),
                    positions,
                    fmt(f["speculated_share"], "{:.0%}"),
                    fmt(f["mean_step_ms"], "{:.1f}"),
                    ratio_cell(f.get("tpot_speedup")),
                    ratio_cell(f.get("tps_ratio")),
                    f["failed"],
                ]
                lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        done = subprocess.run(["lscpu"], capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    found = re.search(r"^Model name:\s*(.+)$", done.stdout, re.M)
    return found.group(1).strip() if found else "?"


def noise(runs: list[dict[str, Any]]) -> str:
    """Other processes' share of the CPUs over the levels: what may have skewed them."""
    shares = [r["other_cpu_share"] for r in runs if r.get("other_cpu_share") is not None]
    if not shares:
        return "other processes' CPU not measured"
    busy = [
        f"{r['workload']} {r['streams']} {r['arm']} round {int(r['round']) + 1}"
        for r in runs
        if (r.get("other_cpu_share") or 0) > 0.1
    ]
    return (
        f"other processes took a median {statistics.median(shares):.0%} of the CPUs during a "
        f"level, at most {max(shares):.0%}; over 10% in: {', '.join(busy) or 'none'}"
    )


def markdown(report: dict[str, Any]) -> str:
    h = report["host"]
    lines = [
        "# Speculative decoding: off, n-gram and int4-draft against an fp32 target",
        "",
        f"- command: `{report['command']}`",
        f"- host: {h['cpus']} CPUs ({h['cpu_model']}), load average {h['loadavg_before']:.2f} "
        f"before, {h['loadavg_after']:.2f} after; {report['date']}",
        f"- {noise(report['runs'])}",
        f"- model: {report['model']}, float32 (`--quantization none`), one colocated worker",
        *(f"- {a}: `pdserve serve {shlex.join(flags)}`" for a, flags in report["flags"].items()),
        f"- {report['rounds']} rounds, medians; streams {report['streams']}, "
        f"{report['max_tokens']} output tokens at most, closed loop, requests a stream "
        + ", ".join(f"{c}: {requests_per_stream(c)}" for c in report["streams"]),
        f"- ignore_eos: copy no, chat {'yes' if report['chat_ignore_eos'] else 'no'}; "
        f"{report['passages']} passages of the project's text (workload sha256 "
        f"{report['workload_sha256'][:12]})",
        "- TPOT off/arm > 1: the arm is faster; tokens/s arm/off > 1: more throughput; "
        "median (min-max) over rounds; acceptance: accepted / verified drafts, by position each "
        "position's own; speculated: share of decode steps that verified drafts; step ms: the "
        "worker's mean engine step (prefills included)",
        "",
        tables(report["summary"]),
        "### aims",
        "",
        *(f"- {status}: {aim}: {figures}" for aim, status, figures in report["aims"]),
        "",
    ]
    return "\n".join(lines)
