"""PNG charts (matplotlib, imported only when ``--plot`` asks for them): latency CDFs of each
run, and for sweeps p99 TTFT, p99 TPOT and SLO attainment against the request rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any  # result rows are JSON: values of every type, read by key

import numpy as np

from pdserve.bench.metrics import RequestOutput, metric_values

CDF_METRICS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el"))


def use_agg() -> None:
    """Files only, no display: matplotlib's Agg backend, chosen before pyplot is imported."""
    import matplotlib

    matplotlib.use("Agg")


def plot_cdfs(runs: list[tuple[str, list[RequestOutput]]], out_dir: str | Path) -> Path:
    """``latency_cdf.png``: one panel per metric, one line per run."""
    use_agg()
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, metric) in zip(axes.flat, CDF_METRICS, strict=True):
        for label, outputs in runs:
            ms = np.sort(np.asarray(metric_values(outputs, metric)) * 1000)
            if ms.size:
                ax.plot(ms, np.arange(1, ms.size + 1) / ms.size, label=label)
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    path = Path(out_dir) / "latency_cdf.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(series: dict[str, list[dict[str, Any]]], path: str | Path, title: str = "") -> Path:
    """p99 TTFT, p99 TPOT and goodput (or attainment) against ``rate``, one line per series
    (a sweep, or one per serving mode in an experiment)."""
    use_agg()
    import matplotlib.pyplot as plt

    panels = (
        ("p99 TTFT (ms)", "p99_ttft_ms"),
        ("p99 TPOT (ms)", "p99_tpot_ms"),
        ("goodput (req/s)", "request_goodput"),
        ("SLO attainment", "slo_attainment"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (label, key) in zip(axes, panels, strict=True):
        for name, rows in series.items():
            points = [(r["rate"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                ax.plot(xs, ys, marker="o", label=name)
        ax.set(title=label, xlabel="request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
