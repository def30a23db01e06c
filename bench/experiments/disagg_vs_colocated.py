"""Disaggregated against colocated serving, same resources, the ``mixed`` workload.

Starts ``pdserve serve`` once per arm on one model (default: SmolLM2-135M-Instruct, pulled on
first use; ``--model small`` for the random one), each time two workers pinned to a core each
(on this 2-core machine):

    disagg           prefill-0 [core 0]   decode-1 [core 1]    --prefill 1 --decode 1 --pin
    conditional      as disagg, with --max-local-prefill-tokens N (``--local-prefill-tokens``):
                     the decode worker prefills short prompts itself, long ones go to prefill-0
    colocated        decode-0 [core 0]    decode-1 [core 1]    --mode colocated ... --pin,
                     stall-free: a step carrying decodes adds only the prompt tokens that keep
                     it within --tpot-target-ms (``--tpot-target-ms``, default the TPOT SLO)
    colocated-stall  as colocated with --tpot-target-ms 0: the old behaviour, prompt chunks up
                     to --max-step-time (0.5 s) beside running streams, for contrast

Every arm but the last has the same TPOT target (it matters where a worker prefills beside
decodes: colocated workers, and the conditional arm's decode worker). ``pdserve bench --dataset
mixed`` runs at each rate: short-prompt, long-output streams arriving at the rate, plus bursts of
long prompts. Writes ``bench/results/disagg_vs_colocated[_MODEL].json`` (``{"command", "rows":
[{"rate", ARM: {...}}], "steps": {ARM: each worker's steps from /metrics}}``; no suffix for
``small``; each figure the median over ``--rounds`` rounds, each round's rows kept) and a PNG
beside it (p99 TPOT, p99 TTFT, goodput at the SLO).

The load: the JSON's ``offered`` gives, per rate, the prompt work (core-seconds a second, from
the model's shipped profile) and the streams in flight at the SLO. This host is slow (SmolLM2
GGUF-kept on one core: a lone decode step ~40 ms, 3-4 streams ~105 ms, ~5.6 ms a prompt token
beside them), so the defaults are a TPOT SLO of 150 ms (the stall-free target) and prompt work of
~0.3-0.5 of a core: one 256-token prompt every 4 s beside the streams, which a colocated worker
can prefill within the target at up to ~1 stream/s.

    .venv/bin/python bench/experiments/disagg_vs_colocated.py           # about 25 min (2 rounds)

The JSON records the machine's load average before and after: other processes on these two
cores show up as noise in every latency.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any  # bench rows and the report are JSON, read back from files

ROOT = Path(__file__).resolve().parents[2]

from pdserve.bench.experiments.cluster import ServeProcess  # noqa: E402
from pdserve.bench.plots import plot_sweep  # noqa: E402
from pdserve.launch.worker_commands import pdserve_command  # noqa: E402

COLOCATED = "--mode=colocated"
MODES = {
    "disagg": [],
    "conditional": [],
    "colocated": [COLOCATED],
    "colocated-stall": [COLOCATED, "--tpot-target-ms=0"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="model directory or name (or small)"
    )
    p.add_argument("--rates", default="0.5,1,1.5", help="stream arrivals per second")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--rounds", type=int, default=2, help="runs of every arm, alternating")
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--slo-ttft-ms", type=float, default=5000.0)
    p.add_argument(
        "--tpot-target-ms",
        type=float,
        default=None,
        help="the stall-free arms' --tpot-target-ms (default: --slo-tpot-ms)",
    )
    p.add_argument("--arms", default=",".join(MODES), help="which arms to run, in order")
    p.add_argument("--stream-input-len", type=int, default=32)
    p.add_argument("--stream-output-len", type=int, default=64)
    p.add_argument("--burst-input-len", type=int, default=256)
    p.add_argument("--burst-output-len", type=int, default=16)
    p.add_argument("--burst-size", type=int, default=1)
    p.add_argument("--burst-interval", type=float, default=4.0)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=128,
        help="the conditional arm's --max-local-prefill-tokens (streams under, bursts over)",
    )
    p.add_argument("--out", default=None, help="default: bench/results/disagg_vs_colocated_MODEL")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from --out's JSON")
    return p.parse_args()


def model_dir(name: str) -> str:
    """A directory for ``--model`` (pulling or making it on first use)."""
    from pdserve.models.store import resolve_model

    return resolve_model(name)


def default_out(name: str) -> Path:
    suffix = "" if name == "small" else f"_{Path(name).name}"
    return ROOT / f"bench/results/disagg_vs_colocated{suffix}.json"


def bench_flags(args: argparse.Namespace, model: str) -> list[str]:
    return [
        "--dataset=mixed",
        f"--tokenizer={model}",
        f"--request-rate={args.rates}",
        f"--duration={args.duration}",
        f"--mixed-stream-input-len={args.stream_input_len}",
        f"--mixed-stream-output-len={args.stream_output_len}",
        f"--mixed-burst-input-len={args.burst_input_len}",
        f"--mixed-burst-output-len={args.burst_output_len}",
        f"--mixed-burst-size={args.burst_size}",
        f"--mixed-burst-interval={args.burst_interval}",
        "--ignore-eos",
        "--temperature=0",
        f"--warmup={args.warmup}",
        "--slo",
        f"tpot:{args.slo_tpot_ms:g}",
        f"ttft:{args.slo_ttft_ms:g}",
        "--no-progress",
    ]


def run_mode(
    args: argparse.Namespace, model: str, mode: str, out: Path
) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """The arm's bench rows, and its workers' steps as /metrics showed them at the end."""
    print(f"== {mode}: starting pdserve serve", flush=True)
    flags = ["--prefill=1", "--decode=1", "--pin", *MODES[mode]]
    if mode == "conditional":
        flags.append(f"--max-local-prefill-tokens={args.local_prefill_tokens}")
    if mode != "colocated-stall":
        flags.append(f"--tpot-target-ms={args.tpot_target_ms or args.slo_tpot_ms:g}")
    cluster = ServeProcess(model, flags)
    try:
        cmd = [*pdserve_command(), "bench", f"--base-url={cluster.url}"]
        cmd += [*bench_flags(args, model), f"--save-result={out}"]
        subprocess.run(cmd, check=True)
        steps = worker_steps(cluster.metrics())
    finally:
        cluster.stop()
    saved = json.loads(out.read_text())
    return saved.get("rows", [saved]), steps  # one rate: the row alone


STEP_LINE = re.compile(
    r"^pdserve_worker_(step_seconds_(?:sum|count)|step_prefill_tokens_sum|step_decode_seqs_sum|"
    r"steps_over_target_total|tpot_target_seconds)\{([^}]*)\} (\S+)$",
    re.M,
)


def worker_steps(metrics: str) -> dict[str, dict[str, float]]:
    """``{worker: {"kind:figure" | "over_target:reason" | "tpot_target_seconds": value}}``."""
    found: dict[str, dict[str, float]] = {}
    for name, labels, value in STEP_LINE.findall(metrics):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        key = name if "kind" not in tags and "reason" not in tags else None
        key = key or f"{tags.get('kind') or 'over_target'}:{name.removeprefix('step_')}"
        if "reason" in tags:
            key = f"over_target:{tags['reason']}"
        found.setdefault(tags.get("worker", "?"), {})[key] = float(value)
    return found


def median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One rate's row over rounds: the median of each figure, and each round's row."""
    numeric = [
        key
        for key in rounds[0]
        if all(type(r.get(key)) in (int, float) and math.isfinite(r[key]) for r in rounds)
    ]
    merged = {key: statistics.median(r[key] for r in rounds) for key in numeric}
    return merged | {"rounds": rounds}


def offered(args: argparse.Namespace, rate: float) -> dict[str, float]:
    """The load at ``rate`` by the model's shipped profile: prompt work in core-seconds a
    second, and streams in flight were each token to take the SLO's TPOT."""
    from pdserve.coordinator.profile import shipped_profile

    profile = shipped_profile(Path(args.model).name)
    if profile is None:
        return {}
    prompt_s = rate * profile.prefill_seconds(args.stream_input_len)
    prompt_s += (
        args.burst_size * profile.prefill_seconds(args.burst_input_len) / args.burst_interval
    )
    in_flight = rate * args.stream_output_len * args.slo_tpot_ms / 1e3
    return {"prompt_core_s_per_s": round(prompt_s, 3), "streams_in_flight_at_slo": in_flight}


TABLE = (  # (key, heading, format)
    ("p99_tpot_ms", "p99 TPOT ms", "{:.1f}"),
    ("p99_itl_ms", "p99 inter-token ms", "{:.0f}"),
    ("median_ttft_ms", "median TTFT ms (mostly short prompts)", "{:.0f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:.0f}"),
    ("request_goodput", "goodput req/s", "{:.2f}"),
    ("slo_attainment", "SLO attainment", "{:.0%}"),
)


def table(rows: list[dict[str, Any]]) -> str:
    modes = [mode for mode in MODES if mode in rows[0]]
    names = " / ".join(modes)
    lines = [
        "| rate (streams/s) | " + " | ".join(f"{h} {names}" for _, h, _ in TABLE) + " |",
        "|---" * (len(TABLE) + 1) + "|",
    ]
    for row in rows:
        cells = [
            " / ".join(fmt.format(row[m].get(key, math.nan)) for m in modes)
            for key, _, fmt in TABLE
        ]
        lines.append(f"| {row['rate']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


WORKLOAD_KEYS = (
    "local_prefill_tokens",
    "tpot_target_ms",
    "slo_ttft_ms",
    "stream_input_len",
    "stream_output_len",
    "burst_input_len",
    "burst_output_len",
    "burst_size",
    "burst_interval",
    "duration",
    "slo_tpot_ms",
)


def draw(report: dict[str, Any], png: Path) -> None:
    w = report["workload"]
    title = (
        f"mixed workload, {report['model']} model, 2 cores: streams {w['stream_input_len']}→"
        f"{w['stream_output_len']} tok; every {w['burst_interval']:g} s {w['burst_size']}×"
        f"{w['burst_input_len']}→{w['burst_output_len']} tok; SLO TPOT ≤ {w['slo_tpot_ms']:g} ms"
        + (f", TTFT ≤ {w['slo_ttft_ms']:g} ms" if w.get("slo_ttft_ms") else "")
    )
    series = {
        mode: [row[mode] for row in report["rows"]] for mode in MODES if mode in report["rows"][0]
    }
    plot_sweep(series, png, title)
    print(table(report["rows"]))
    print(f"wrote {png}")


def main() -> int:
    args = parse_args()
    out = Path(args.out) if args.out else default_out(args.model)
    if args.replot:
        draw(json.loads(out.read_text()), out.with_suffix(".png"))
        return 0
    model = model_dir(args.model)
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in MODES]:
        raise SystemExit(f"unknown arms {unknown}: choose from {list(MODES)}")
    load_before = os.getloadavg()
    # arm -> rounds -> rows by rate
    runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in arms}
    steps: dict[str, list[dict[str, dict[str, float]]]] = {m: [] for m in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):  # the arms alternate: a slow spell hits each alike
            for mode in arms:
                rows_, steps_ = run_mode(args, model, mode, Path(tmp) / f"{mode}-{rnd}.json")
                runs[mode].append(rows_)
                steps[mode].append(steps_)
    rates = [float(r) for r in args.rates.split(",")]
    rows = [
        {
            "rate": rate,
            "offered": offered(args, rate),
            **{m: median_row([r[i] for r in runs[m]]) for m in arms},
        }
        for i, rate in enumerate(rates)
    ]
    command = shlex.join([".venv/bin/python", "bench/experiments/disagg_vs_colocated.py"])
    command += "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    bench_cmd = shlex.join(["pdserve", "bench", "--base-url=URL", *bench_flags(args, "MODEL")])
    model_name = Path(args.model).name
    machine = {"cpus": os.cpu_count(), "loadavg_before": load_before}
    machine["loadavg_after"] = os.getloadavg()
    workload = {key: getattr(args, key) for key in WORKLOAD_KEYS}
    report: dict[str, Any] = {"command": command, "bench_command": bench_cmd, "model": model_name}
    report |= {"workload": workload, "machine": machine, "rows": rows, "steps": steps}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print(f"wrote {out}")
    draw(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
