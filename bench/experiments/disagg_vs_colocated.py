"""Disaggregated against colocated serving, same resources, the ``mixed`` workload.

Starts ``pdserve serve`` twice on one model (default: SmolLM2-135M-Instruct, pulled on first
use; ``--model small`` for the random one), each time two workers pinned to a core each (on
this 2-core machine):

    disagg     prefill-0 [core 0]   decode-1 [core 1]      --prefill 1 --decode 1 --pin
    colocated  decode-0  [core 0]   decode-1 [core 1]      --mode colocated ... --pin

and runs ``pdserve bench --dataset mixed`` at each rate against both: short-prompt, long-output
streams arriving at the rate, plus bursts of long prompts. Writes
``bench/results/disagg_vs_colocated[_MODEL].json`` (``{"command", "rows": [{"rate", "disagg",
"colocated"}]}``; no suffix for ``small``) and a PNG beside it (p99 TPOT, p99 TTFT, goodput at
the TPOT SLO).

    .venv/bin/python bench/experiments/disagg_vs_colocated.py                 # about 5 min
    .venv/bin/python bench/experiments/disagg_vs_colocated.py --burst-output-len 1 \
        --out bench/results/disagg_vs_colocated_prefill_only.json

The JSON records the machine's load average before and after: other processes on these two
cores show up as noise in every latency.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.cluster import ServeProcess  # noqa: E402
from bench.plots import plot_sweep  # noqa: E402
from launch.serve import pdserve_command  # noqa: E402

MODES = {"disagg": [], "colocated": ["--mode=colocated"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="model directory or name (or small)"
    )
    p.add_argument("--rates", default="1,2,3", help="stream arrivals per second")
    p.add_argument("--duration", type=float, default=25.0, help="seconds of arrivals per rate")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--stream-input-len", type=int, default=32)
    p.add_argument("--stream-output-len", type=int, default=64)
    p.add_argument("--burst-input-len", type=int, default=1024)
    p.add_argument("--burst-output-len", type=int, default=16)
    p.add_argument("--burst-size", type=int, default=2)
    p.add_argument("--burst-interval", type=float, default=3.0)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--out", default=None, help="default: bench/results/disagg_vs_colocated_MODEL")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from --out's JSON")
    return p.parse_args()


def model_dir(name: str) -> str:
    """A directory for ``--model`` (pulling or making it on first use)."""
    from engine.model_store import resolve_model

    return resolve_model(name)


def default_out(name: str) -> Path:
    suffix = "" if name == "small" else f"_{Path(name).name}"
    return ROOT / f"bench/results/disagg_vs_colocated{suffix}.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        "--no-progress",
    ]


def run_mode(args: argparse.Namespace, model: str, mode: str, out: Path) -> list[dict]:
    print(f"== {mode}: starting pdserve serve", flush=True)
    cluster = ServeProcess(model, ["--prefill=1", "--decode=1", "--pin", *MODES[mode]])
    try:
        cmd = [*pdserve_command(), "bench", f"--base-url={cluster.url}"]
        cmd += [*bench_flags(args, model), f"--save-result={out}"]
        subprocess.run(cmd, check=True)
    finally:
        cluster.stop()
    return json.loads(out.read_text())["rows"]


def table(rows: list[dict]) -> str:
    head = "| rate (streams/s) | p99 TPOT ms disagg / coloc | p99 TTFT ms disagg / coloc |"
    head += " goodput req/s disagg / coloc | SLO attainment disagg / coloc |"
    lines = [head, "|---|---|---|---|---|"]
    for row in rows:
        d, c = row["disagg"], row["colocated"]
        lines.append(
            f"| {row['rate']:g} | {d['p99_tpot_ms']:.1f} / {c['p99_tpot_ms']:.1f}"
            f" | {d['p99_ttft_ms']:.0f} / {c['p99_ttft_ms']:.0f}"
            f" | {d['request_goodput']:.2f} / {c['request_goodput']:.2f}"
            f" | {d['slo_attainment']:.0%} / {c['slo_attainment']:.0%} |"
        )
    return "\n".join(lines)


WORKLOAD_KEYS = (
    "stream_input_len",
    "stream_output_len",
    "burst_input_len",
    "burst_output_len",
    "burst_size",
    "burst_interval",
    "duration",
    "slo_tpot_ms",
)


def draw(report: dict, png: Path) -> None:
    w = report["workload"]
    title = (
        f"mixed workload, {report['model']} model, 2 cores: streams {w['stream_input_len']}→"
        f"{w['stream_output_len']} tok; every {w['burst_interval']:g} s {w['burst_size']}×"
        f"{w['burst_input_len']}→{w['burst_output_len']} tok; SLO TPOT ≤ {w['slo_tpot_ms']:g} ms"
    )
    series = {mode: [row[mode] for row in report["rows"]] for mode in MODES}
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
    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            results[mode] = run_mode(args, model, mode, Path(tmp) / f"{mode}.json")
    rates = [float(r) for r in args.rates.split(",")]
    rows = [
        {"rate": rate, "disagg": d, "colocated": c}
        for rate, d, c in zip(rates, results["disagg"], results["colocated"], strict=True)
    ]
    command = shlex.join([".venv/bin/python", "bench/experiments/disagg_vs_colocated.py"])
    command += "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    bench_cmd = shlex.join(["pdserve", "bench", "--base-url=URL", *bench_flags(args, "MODEL")])
    model_name = Path(args.model).name
    machine = {"cpus": os.cpu_count(), "loadavg_before": load_before}
    machine["loadavg_after"] = os.getloadavg()
    workload = {key: getattr(args, key) for key in WORKLOAD_KEYS}
    report = {"command": command, "bench_command": bench_cmd, "model": model_name}
    report |= {"workload": workload, "machine": machine, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print(f"wrote {out}")
    draw(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
