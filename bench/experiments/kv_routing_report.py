"""The report of ``kv_routing.py``: each arm's medians over its rounds, and beside the JSON a
markdown table (the medians, then every run) and a PNG (four figures, bars for the medians and
dots for the runs)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any  # the report is JSON, read back from its file by --replot

ARMS = ("kv", "load")
FIGURES = (  # (key in a run's figures, label, format)
    ("ttft_p50_ms", "turns 3+ median TTFT ms", "{:.0f}"),
    ("tpot_p50_ms", "turns 3+ median TPOT ms", "{:.1f}"),
    ("cached_fraction", "turns 3+ prompt tokens cached (usage)", "{:.0%}"),
    ("computed_tokens", "turns 3+ prompt tokens not cached (usage)", "{:.0f}"),
    ("completed", "turns 3+ completed", "{:.0f}"),
    ("prefill_tokens", "prompt tokens computed, every turn (workers' /metrics)", "{:.0f}"),
    ("kv_mb_sent", "KV MB moved, every turn (workers' /metrics)", "{:.1f}"),
)


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each arm's median of each figure over its runs."""
    return {
        arm: {
            key: statistics.median(r[key] for r in runs if r["arm"] == arm) for key, _, _ in FIGURES
        }
        for arm in ARMS
    }


def table(report: dict[str, Any]) -> str:
    med = report["median"]
    lines = [
        "| figure (median over rounds) | kv | load | load / kv |",
        "|---|---|---|---|",
    ]
    for key, label, fmt in FIGURES:
        kv, load = med["kv"][key], med["load"][key]
        ratio = f"{load / kv:.2f}" if kv else "-"
        lines.append(f"| {label} | {fmt.format(kv)} | {fmt.format(load)} | {ratio} |")
    lines += [
        "",
        "| run | arm | TTFT p50 ms | TPOT p50 ms | cached | not cached | prompt tokens computed"
        " | KV MB moved | routing decisions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(report["runs"]):
        routing = ", ".join(f"{k} {v:g}" for k, v in sorted(r["routing"].items()))
        lines.append(
            f"| {i + 1} | {r['arm']} | {r['ttft_p50_ms']:.0f} | {r['tpot_p50_ms']:.1f}"
            f" | {r['cached_fraction']:.0%} | {r['computed_tokens']}"
            f" | {r['prefill_tokens']:.0f} | {r['kv_mb_sent']:.1f}"
            f" | {routing} |"
        )
    return "\n".join(lines)


def draw(report: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("ttft_p50_ms", "median TTFT, turns ≥ 3 (ms)"),
        ("tpot_p50_ms", "median TPOT, turns ≥ 3 (ms)"),
        ("prefill_tokens", "prompt tokens computed (all turns)"),
        ("kv_mb_sent", "KV MB moved (all turns)"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 3.8))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for x, arm in enumerate(ARMS):
            values = [r[key] for r in report["runs"] if r["arm"] == arm]
            ax.bar(x, report["median"][arm][key], color=("C0", "C1")[x], alpha=0.6)
            ax.scatter([x] * len(values), values, color="k", s=12, zorder=3)
        ax.set_xticks(range(len(ARMS)), [f"--routing {a}" for a in ARMS])
        ax.set_title(title, fontsize="medium")
        ax.grid(axis="y", alpha=0.3)
    w = report["workload"]
    fig.suptitle(
        f"multi-turn, {report['model']}, 2 prefill + 2 decode on 2 cores: {w['conversations']} "
        f"conversations × {w['turns']} turns, system {w['system_len']}, user {w['user_len']}, "
        f"answer {w['output_len']} tokens, {w['concurrency']} in flight (bars: median; dots: runs)",
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def write(report: dict[str, Any], out: Path) -> None:
    md = out.with_suffix(".md")
    loads = [x[0] for r in report["runs"] for x in r["loadavg"]]
    noise = (
        f"{report['machine']['cpus']} cores shared with other processes: the 1-minute load "
        f"average ran {min(loads):.1f}-{max(loads):.1f} around the runs."
    )
    md.write_text(
        f"# KV-aware routing vs load, multi-turn\n\n`{report['command']}`\n\n{noise}\n\n"
        f"{table(report)}\n"
    )
    draw(report, out.with_suffix(".png"))
    print(table(report))
    print(f"wrote {out}, {md.name}, {out.with_suffix('.png').name}")
