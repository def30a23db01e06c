"""The autoscale trace benchmark's figures (``autoscale_trace.py``): per arm and round from the
requests' outputs and the poller's samples; medians over rounds; the markdown table; the PNG
(per arm: the arrival rate, live and desired workers over time; attainment bars)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any  # the report is JSON, read back by --replot

from pdserve.bench.metrics import RequestOutput, Slo, meets_slo
from pdserve.bench.metrics import summarize as bench_summary
from pdserve.bench.plots import use_agg

if TYPE_CHECKING:
    from matplotlib.axes import Axes

ROLES = ("prefill", "decode")
BIN_S = 10.0  # arrival rate bins
SCALARS = (  # (key, heading, format): the table's columns, medians over rounds
    ("requests", "requests", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("attain_ttft", "TTFT ≤ SLO", "{:.1%}"),
    ("attain_tpot", "TPOT ≤ SLO", "{:.1%}"),
    ("attain_both", "both", "{:.1%}"),
    ("median_ttft_ms", "p50 TTFT ms", "{:.0f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:.0f}"),
    ("median_tpot_ms", "p50 TPOT ms", "{:.1f}"),
    ("p99_tpot_ms", "p99 TPOT ms", "{:.1f}"),
    ("worker_seconds", "worker-s", "{:.0f}"),
    ("mean_workers", "mean workers", "{:.2f}"),
    ("max_workers", "max workers", "{:.0f}"),
    ("duration_s", "run s", "{:.0f}"),
)


def attainment(outputs: list[RequestOutput], slo: Slo) -> float | None:
    """The share of ``outputs`` meeting ``slo`` (failed ones miss); None for no outputs."""
    return sum(meets_slo(o, slo) for o in outputs) / len(outputs) if outputs else None


def worker_seconds(samples: list[dict[str, Any]], duration: float) -> tuple[float, int]:
    """Live workers (both roles) integrated over [0, duration], each sample's count held until
    the next (the first one's from 0; a sample without counts holds the last), and the most."""
    points = [(s["t"], s["live_prefill"] + s["live_decode"]) for s in samples if "live_decode" in s]
    if not points:
        raise ValueError("the poller read no worker counts")
    total, peak = 0.0, max(n for _, n in points)
    for k, (t, n) in enumerate(points):
        start = 0.0 if k == 0 else min(max(t, 0.0), duration)
        end = points[k + 1][0] if k + 1 < len(points) else duration
        total += n * max(0.0, min(end, duration) - start)
    return total, peak


def arm_figures(
    outputs: list[RequestOutput],
    duration: float,
    samples: list[dict[str, Any]],
    slo_s: tuple[float, float],
    phases: list[str],
) -> dict[str, Any]:
    """One arm's round: ``phases`` is each output's trace phase (outputs in send order)."""
    ttft_ms, tpot_ms = slo_s[0] * 1000, slo_s[1] * 1000
    both = Slo(ttft_ms=ttft_ms, tpot_ms=tpot_ms)
    summary = bench_summary(outputs, duration, both, percentiles=(99,))
    work, peak = worker_seconds(samples, duration)
    bins = [0] * (int(duration // BIN_S) + 1)
    for o in outputs:
        bins[int(o.start_time // BIN_S)] += 1
    figures: dict[str, Any] = {
        "requests": len(outputs),
        "failed": summary["failed"],
        "errors": summary["error_summary"],
        "attain_ttft": attainment(outputs, Slo(ttft_ms=ttft_ms)),
        "attain_tpot": attainment(outputs, Slo(tpot_ms=tpot_ms)),
        "attain_both": summary["slo_attainment"],
        "worker_seconds": work,
        "mean_workers": work / duration,
        "max_workers": peak,
        "duration_s": duration,
    }
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"):
        figures[key] = summary[key]
    groups = {
        f"phase_{p}": [o for o, q in zip(outputs, phases, strict=True) if q == p]
        for p in dict.fromkeys(phases)
    }
    groups |= {f"kind_{k}": [o for o in outputs if o.kind == k] for k in ("stream", "burst")}
    figures["attain_both_by"] = {name: attainment(outs, both) for name, outs in groups.items()}
    figures["arrivals_per_s"] = [n / BIN_S for n in bins]
    figures["per_request"] = [  # [start s, kind, phase, TTFT s, TPOT s, error]
        [o.start_time, o.kind, p, o.ttft if o.success else None, o.tpot, o.error[:200]]
        for o, p in zip(outputs, phases, strict=True)
    ]
    return figures


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each arm's ``SCALARS`` and attainment by phase and kind: medians over rounds."""
    out: dict[str, dict[str, Any]] = {}
    for arm, rs in rounds.items():
        out[arm] = {key: statistics.median(r[key] for r in rs) for key, _, _ in SCALARS}
        out[arm]["attain_both_by"] = {
            name: _median([r["attain_both_by"].get(name) for r in rs])
            for name in rs[0]["attain_both_by"]
        }
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def table(report: dict[str, Any]) -> str:
    """Markdown: one row per arm; then attainment (both SLOs) by phase and kind."""
    results = report["results"]
    lines = ["| arm | " + " | ".join(h for _, h, _ in SCALARS) + " |"]
    lines.append("|---" * (len(SCALARS) + 1) + "|")
    for arm, r in results.items():
        lines.append(f"| {arm} | " + " | ".join(f.format(r[k]) for k, _, f in SCALARS) + " |")
    names = list(next(iter(results.values()))["attain_both_by"])
    lines += ["", "| arm | " + " | ".join(n.replace("_", " ") for n in names) + " |"]
    lines.append("|---" * (len(names) + 1) + "|")
    for arm, r in results.items():
        cells = [
            "-" if r["attain_both_by"][n] is None else f"{r['attain_both_by'][n]:.0%}"
            for n in names
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw(report: dict[str, Any], out: Path) -> None:
    """``out`` with .md (the table and the command) and .png beside the JSON."""
    t = report["trace"]
    text = f"`{report['command']}`\n\n{t['model']}, {t['rounds']} round(s), SLO TTFT ≤ "
    text += f"{t['slo_ttft']:g} s, TPOT ≤ {t['slo_tpot']:g} s\n\n{table(report)}\n"
    out.with_suffix(".md").write_text(text)
    print(table(report))
    use_agg()
    import matplotlib.pyplot as plt

    arms = list(report["rounds"])
    fig, axes = plt.subplots(len(arms) + 1, 1, figsize=(10, 3.2 * (len(arms) + 1)))
    for ax, arm in zip(axes, arms, strict=False):
        _timeline(ax, arm, report["rounds"][arm][0], t)
    _bars(axes[-1], report["results"])
    fig.suptitle(f"bursty trace, {report['model']}, round 1 over time", fontsize="medium")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    plt.close(fig)
    print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.png')}")


def _timeline(ax: Axes, arm: str, r: dict[str, Any], trace: dict[str, Any]) -> None:
    knots = trace["knots"]
    ax.plot([k[0] for k in knots], [k[1] for k in knots], color="grey", label="trace rate")
    rates = r["arrivals_per_s"]
    ax.step(
        [BIN_S * i for i in range(len(rates))],
        rates,
        where="post",
        color="silver",
        label=f"arrivals/s ({BIN_S:g} s bins)",
    )
    ax.set(ylabel="streams/s", xlabel="s", title=f"{arm}: {r['worker_seconds']:.0f} worker-s")
    ax.axvspan(knots[2][0], knots[3][0], color="khaki", alpha=0.3, label="high phase, bursts")
    workers = ax.twinx()
    samples = [s for s in r["samples"] if "live_decode" in s]
    times = [s["t"] for s in samples]
    total = [s["live_prefill"] + s["live_decode"] for s in samples]
    workers.step(times, total, where="post", color="black", label="live workers")
    for role, color, nudge in zip(ROLES, ("tab:orange", "tab:blue"), (-0.06, 0.06), strict=True):
        live = [s[f"live_{role}"] + nudge for s in samples]
        desired = [s.get(f"desired_{role}", float("nan")) + nudge for s in samples]
        workers.step(times, live, where="post", color=color, label=f"live {role}")
        workers.step(times, desired, where="post", color=color, ls="--", label=f"desired {role}")
    workers.set_ylabel("workers (roles nudged apart)")
    desired = [s.get(f"desired_{role}") or 0 for s in samples for role in ROLES]
    workers.set_ylim(0, max([*total, *desired]) + 1.5)
    lines = ax.get_legend_handles_labels()
    more = workers.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize="x-small", ncol=3, loc="upper left")


def _bars(ax: Axes, results: dict[str, dict[str, Any]]) -> None:
    keys = (("attain_ttft", "TTFT"), ("attain_tpot", "TPOT"), ("attain_both", "both"))
    width = 0.8 / len(results)
    for i, (arm, r) in enumerate(results.items()):
        xs = [k + i * width for k in range(len(keys))]
        label = f"{arm} ({r['worker_seconds']:.0f} worker-s)"
        ax.bar(xs, [r[k] for k, _ in keys], width, label=label)
    ax.set_xticks([k + width * (len(results) - 1) / 2 for k in range(len(keys))])
    ax.set_xticklabels([name for _, name in keys])
    ax.set(ylim=(0, 1.05), ylabel="SLO attainment (medians of rounds)")
    ax.legend(fontsize="small")
