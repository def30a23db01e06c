"""sim_validate.py's report: the JSON as it is, a markdown report (scales, every figure real
against simulated, the winners, where it misses and why) and a PNG (simulated against real,
every figure, calibrated and not, with the aims' bands)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any  # the report is JSON

from pdserve.bench.experiments.sim_validate_misses import misses

Json = dict[str, Any]
UNITS = {"_ms": "ms", "goodput": "req/s", "attainment": "", "fraction": "", "tokens": "tokens"}


def fmt(value: float | None, figure: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if "fraction" in figure or "attainment" in figure or "share" in figure:
        return f"{value:.0%}"
    if "goodput" in figure:
        return f"{value:.2f}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:+.0%}"


def figures_table(report: Json, exp: str) -> list[str]:
    lines = [
        "| case | figure | real (rounds) | sim | error | aim | within | uncalibrated sim (error) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in report["figures"]:
        if f["experiment"] != exp:
            continue
        name = f["figure"]
        rounds = " / ".join(fmt(v, name) for v in f["real_rounds"])
        lines.append(
            f"| {f['case']} | {name} | {fmt(f['real'], name)} ({rounds}) | {fmt(f['sim'], name)} "
            f"| {pct(f['error'])} | {f['aim']:.0%} | {'yes' if f['within'] else '**no**'} "
            f"| {fmt(f['sim_uncalibrated'], name)} ({pct(f['error_uncalibrated'])}) |"
        )
    return lines


def winners_table(report: Json) -> list[str]:
    lines = [
        "| experiment | case | figure | better | real (arms) | real winner | every real round "
        "agrees | sim (arms) | sim winner | same |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["comparisons"]:
        name = c["figure"]
        real = " / ".join(f"{a} {fmt(v, name)}" for a, v in c["real"].items())
        sim = "-" if c["sim"] is None else " / ".join(fmt(v, name) for v in c["sim"].values())
        agree = {True: "yes", False: "no (noise)", None: "-"}[c["real_rounds_agree"]]
        same = {True: "yes", False: "**no**", None: "not replayed"}[c["same"]]
        lines.append(
            f"| {c['experiment']} | {c['case']} | {name} | {c['better']} | {real} "
            f"| {c['real_winner']} | {agree} | {sim} | {c['sim_winner'] or '-'} | {same} |"
        )
    return lines


def scales_table(report: Json) -> list[str]:
    lines = [
        "| experiment | run | prefill scale | decode scale | from |",
        "|---|---|---|---|---|",
    ]
    for name, e in report["experiments"].items():
        s = e["scales"]
        lines.append(
            f"| {name} | {e['run']} | {s['prefill']:.2f} | {s['decode']:.2f} | {s['from']} |"
        )
    return lines


def markdown(report: Json) -> str:
    s = report["summary"]
    prof, link = report["profile"], report["link"]
    out = [
        "# The simulator against the real runs",
        "",
        f"`{report['command']}` (issue 40, item 3): every experiment committed under "
        "bench/results/ replayed in the simulator (sim/) with its workload as the real run "
        "sent it (the bench's own generators and seeds) and its arms as the script started them.",
        "",
        f"Profile: `{prof['file']}`, measured {prof['measured']}: a lone decode step "
        f"{prof['lone_decode_ms']:.1f} ms. Each run's host was slower or faster that day: the "
        "profile's prefill and decode seconds are scaled by two factors read off the run's own "
        "step counters (sim/calibrate.py; mean step against the profile's at the mean batch "
        "or prompt chunk). KV link "
        f"{link['bandwidth_mb_s']:.0f} MB/s + {link['latency_s'] * 1e3:g} ms ({link['source']}), "
        f"{report['kv_bytes_per_token']:,} bytes a token (float32 KV), one hop between "
        f"processes {report['hop_s'] * 1e3:g} ms (two processes on two shared cores). Aims: "
        f"p50-class figures within {report['aims']['p50_class']:.0%}, tails (p90, p99, max) "
        f"and goodput / attainment within {report['aims']['tail_class']:.0%}.",
        "",
        "## Summary",
        "",
        f"- **{s['within']} of {s['figures']} figures within the aim** ({s['within_uncalibrated']}"
        f" with the uncalibrated profile): p50-class {s['p50_class'][0]} of {s['p50_class'][1]}, "
        f"tails and goodput {s['tail_class'][0]} of {s['tail_class'][1]}.",
        f"- **Same winner in {s['same_winner']} of {s['comparisons']} comparisons** the real "
        f"runs made ({s['robust_same_winner']} of the {s['robust_comparisons']} whose winner "
        f"every real round agrees on); {s['not_replayed_comparisons']} not replayed (the "
        "autoscale arm).",
        "",
        "| experiment | figures | within aim | within aim, uncalibrated |",
        "|---|---|---|---|",
    ]
    for name, e in s["by_experiment"].items():
        out.append(f"| {name} | {e['figures']} | {e['within']} | {e['within_uncalibrated']} |")
    out += ["", "## Host-speed scales", "", *scales_table(report), ""]
    for name, e in report["experiments"].items():
        out += [f"## {name}", "", f"From `{e['source']}` ({e['run']}).", ""]
        out += [*(f"- {note}" for note in e["notes"]), ""]
        out += [*figures_table(report, name), ""]
    out += ["## Winners", "", *winners_table(report), ""]
    out += ["## Where it misses and why", "", *misses(report), ""]
    out += ["![simulated against real](sim_validation.png)", ""]
    return "\n".join(out)


def draw(report: Json, png: Path) -> None:
    """Left: simulated against real, every figure (log axes, the aims' bands); right: each
    figure's error, calibrated and not, by experiment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exps = list(report["experiments"])
    colors = dict(zip(exps, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 6.2), gridspec_kw={"width_ratios": [1, 1.5]})
    lo, hi, floor = 3e-2, 3e4, 3e-2
    xs = [lo, hi]
    ax.fill_between(xs, [x * 0.75 for x in xs], [x * 1.25 for x in xs], color="0.9", lw=0)
    ax.fill_between(xs, [x * 0.85 for x in xs], [x * 1.15 for x in xs], color="0.75", lw=0)
    ax.plot(xs, xs, color="0.4", lw=0.8)
    for exp in exps:
        for tail in (False, True):
            pts = [
                (f["real"], max(f["sim"], floor))
                for f in report["figures"]
                if f["experiment"] == exp and (f["aim"] > 0.2) == tail and f["real"] > 0
            ]
            if pts:
                ax.scatter(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    s=22,
                    color=colors[exp],
                    marker="^" if tail else "o",
                    alpha=0.8,
                    label=f"{exp} ({'tails, goodput' if tail else 'p50-class'})",
                )
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi))
    ax.set(title="calibrated to each run's host speed", xlabel="real (ms, req/s, share, tokens)")
    ax.set_ylabel("simulated (same unit; a 0 drawn at the floor)")
    ax.grid(True, which="major", lw=0.3)
    ax.legend(fontsize=7, loc="upper left")

    cap = 1.5
    bx.axhspan(-0.25, 0.25, color="0.9", lw=0)
    bx.axhspan(-0.15, 0.15, color="0.75", lw=0)
    bx.axhline(0, color="0.4", lw=0.8)
    for i, f in enumerate(report["figures"]):
        color = colors[f["experiment"]]
        for key, filled in (("error", True), ("error_uncalibrated", False)):
            if f[key] is None or not math.isfinite(f[key]):
                continue
            y = max(-1.0, min(cap, f[key]))
            bx.scatter(i, y, s=14, marker="o", color=color if filled else "none", edgecolors=color)
    starts: dict[str, int] = {}
    for i, f in enumerate(report["figures"]):
        starts.setdefault(f["experiment"], i)
    for k, (exp, i) in enumerate(starts.items()):
        bx.axvline(i - 0.5, color="0.6", lw=0.5)
        bx.text(i, cap * 0.97 - 0.09 * k, exp, fontsize=8, va="top", color=colors[exp])
    bx.set(ylim=(-1.05, cap + 0.05), xlim=(-1, len(report["figures"])))
    bx.set(title="error per figure: filled calibrated, hollow uncalibrated (clipped at +150%)")
    bx.set_xlabel("figures in the report's order (disagg_vs_colocated: rate, arm, figure)")
    bx.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    s = report["summary"]
    fig.suptitle(
        f"simulator vs real runs: {s['within']}/{s['figures']} figures within the aim "
        f"(bands ±15%, ±25%; {s['within_uncalibrated']} uncalibrated), "
        f"{s['same_winner']}/{s['comparisons']} winners the same"
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write(report: Json, out: Path) -> None:
    """``out`` (JSON), and the .md and .png beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(report), indent=1, allow_nan=False) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    draw(report, out.with_suffix(".png"))


def _clean(value: Any) -> Any:
    """JSON as it is, a figure that is not a number (a prompt with no token in the window,
    an error against a real 0) as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value
