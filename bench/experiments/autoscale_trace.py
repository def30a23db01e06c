"""A bursty trace against a fixed 1P1D cluster and against ``pdserve serve --autoscale``.

The trace (seeded, the same in both arms of a round) runs ``--duration`` s, split in phases::

    rate  high ┤            ┌──────────┐
               │          ╱            ╲          streams: Poisson at the rate, short prompts,
          low  ┤─────────╱              ╲────────  outputs of mixed lengths
               low    rise     high     fall   low
    bursts                   B        B        --burst-size long prompts every
                                               --burst-interval s in the high phase

Two arms, one cluster each (``pdserve serve``, started afresh per arm and round):

    fixed      --prefill 1 --decode 1 --pin --threads 1
    autoscale  the same, plus --autoscale --max-workers K (starts as 1P1D)

The core budget is the same: every worker runs one torch thread and ``--pin`` puts worker slot
``i`` on core ``i mod cores``, so the autoscaler's extra workers share the cores the fixed
arm's two use (on a 2-core machine: both arms' workers on cores 0 and 1). Both clusters get the
planner's SLOs equal to the benchmark's (``--ttft-slo``, ``--tpot-slo``).

Each cluster is warmed up (four short requests, one at a time), then left idle ``--settle`` s
and until its plan and workers are 1P1D again (``--settle-max``), so that neither arm starts the
trace scaled up by the warm-up. Once a second a poller (``autoscale_trace_poll.py``) reads the
live workers per role and the planner's desired workers. Per arm: SLO attainment (TTFT, TPOT
and both; by phase and by kind), p50/p99 TTFT and TPOT, failed requests, worker-seconds (live
workers integrated over the run) and the autoscaler's actions (its log); each request's figures.
Medians over ``--rounds``; a JSON, a markdown table and a PNG (``autoscale_trace_report.py``).

The defaults fit one torch thread per worker on this 2-core machine (a 2,048-token prompt took
20-30 s to prefill on one shared thread): 0.15 -> 0.5 -> 0.15 streams/s, two bursts of
2 x 1,024-2,048 tokens, SLO TTFT <= 4 s and TPOT <= 0.25 s.

    .venv/bin/python bench/experiments/autoscale_trace.py                 # 1 round: ~10 min
    .venv/bin/python bench/experiments/autoscale_trace.py --duration-scale 0.2 --model small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any  # rounds and the report are JSON, read back by --replot

import httpx
import numpy as np

from pdserve.bench.client import Target
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.experiments.autoscale_trace_poll import Poller, settle
from pdserve.bench.experiments.autoscale_trace_report import arm_figures, draw, summarize
from pdserve.bench.experiments.cluster import ROOT, ServeProcess
from pdserve.bench.metrics import RequestOutput
from pdserve.bench.prompts import TokenPrompts, load_tokenizer
from pdserve.bench.report import Progress
from pdserve.bench.runner import RunSpec, make_client, run_requests

ARMS = ("fixed", "autoscale")
# the rate's knots: (fraction of the duration, "low" or "high"); phases lie between knots
KNOTS = ((0.0, "low"), (0.2, "low"), (0.35, "high"), (0.65, "high"), (0.8, "low"), (1.0, "low"))
PHASES = ("low", "rise", "high", "fall", "low2")


def rate_at(t: float, args: argparse.Namespace) -> float:
    """The trace's arrival rate (streams/s) at ``t`` s: piecewise linear through ``KNOTS``."""
    fractions = [f * args.duration for f, _ in KNOTS]
    rates = [args.high_rate if r == "high" else args.low_rate for _, r in KNOTS]
    return float(np.interp(t, fractions, rates))


def phase_of(t: float, args: argparse.Namespace) -> str:
    ends = [f * args.duration for f, _ in KNOTS[1:]]
    return PHASES[min(int(np.searchsorted(ends, t, side="right")), len(PHASES) - 1)]


def burst_times(args: argparse.Namespace) -> list[float]:
    """Every ``--burst-interval`` s within the high phase, the first half an interval in."""
    start, end = KNOTS[2][0] * args.duration, KNOTS[3][0] * args.duration
    times = np.arange(start + args.burst_interval / 2, end, args.burst_interval)
    return [float(t) for t in times]


def build_trace(args: argparse.Namespace, maker: TokenPrompts, seed: int) -> list[BenchRequest]:
    """The requests with their send times (``at``), in time order: streams by thinning a
    Poisson process at the high rate down to ``rate_at``, bursts at ``burst_times``."""
    rng = np.random.default_rng(seed)
    peak = max(args.high_rate, args.low_rate)
    out, t = [], 0.0
    while (t := t + rng.exponential(1 / peak)) < args.duration:
        if rng.random() * peak < rate_at(t, args):
            n_in = int(rng.integers(args.stream_input[0], args.stream_input[1] + 1))
            n_out = int(rng.choice(args.stream_outputs))
            out.append(BenchRequest(maker.text(n_in, rng), n_out, n_in, kind="stream", at=t))
    for t in burst_times(args):
        for _ in range(args.burst_size):
            n_in = int(rng.integers(args.burst_input[0], args.burst_input[1] + 1))
            req = BenchRequest(maker.text(n_in, rng), args.burst_output, n_in, kind="burst", at=t)
            out.append(req)
    return sorted(out, key=lambda r: r.at or 0.0)


def serve_flags(arm: str, args: argparse.Namespace) -> list[str]:
    flags = ["--prefill=1", "--decode=1", "--pin", "--threads=1", "--num-kv-blocks=1024"]
    flags += [f"--ttft-slo={args.slo_ttft}", f"--tpot-slo={args.slo_tpot}", *args.serve_flag]
    if arm == "autoscale":
        flags += ["--autoscale", f"--max-workers={args.max_workers}"]
    return flags


async def replay(
    url: str, model: str, requests: list[BenchRequest], label: str
) -> tuple[list[RequestOutput], float]:
    """The requests at their times (``at``), streamed: (outputs, duration)."""
    target = Target(url, model=model, ignore_eos=True, temperature=0.0)
    async with make_client(600) as client:
        return await run_requests(client, target, requests, RunSpec(), Progress(label))


def run_arm(
    arm: str,
    args: argparse.Namespace,
    trace: list[BenchRequest],
    warm: list[BenchRequest],
    log: Path,
) -> dict[str, Any]:
    """One arm of one round on a fresh cluster: the trace's figures (``arm_figures``)."""
    load = os.getloadavg()
    serve = ServeProcess(args.model_dir, serve_flags(arm, args), log=log)
    try:
        model = httpx.get(f"{serve.url}/v1/models", timeout=30).json()["data"][0]["id"]
        warmed, _ = asyncio.run(replay(serve.url, model, warm, f"{arm} warm-up "))
        if not all(o.success for o in warmed):
            raise RuntimeError(f"{arm}: a warm-up request failed: {warmed}")
        start = settle(serve.url, model, args.settle, args.settle_max)
        print(f"{arm}: trace starts at {start}", flush=True)
        poller = Poller(serve.url, model, time.perf_counter())
        poller.start()  # run_requests' own clock starts a few microseconds later
        try:
            outputs, duration = asyncio.run(replay(serve.url, model, trace, f"{arm} "))
        finally:
            samples = poller.stop()
    finally:
        serve.stop()
    lines = [line.split(": autoscale: ", 1) for line in log.read_text().splitlines()]
    actions = [parts[1] for parts in lines if len(parts) == 2 and not parts[1].startswith("plan:")]
    phases = [phase_of(r.at or 0.0, args) for r in trace]
    figures = arm_figures(outputs, duration, samples, (args.slo_ttft, args.slo_tpot), phases)
    figures |= {"start": start, "loadavg": [load, os.getloadavg()]}
    return figures | {"autoscale_actions": actions, "samples": samples}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="name or directory (small)")
    p.add_argument("--rounds", type=int, default=1, help="each arm's figures: medians of these")
    p.add_argument("--duration", type=float, default=200.0, help="s of trace (before scaling)")
    p.add_argument("--duration-scale", type=float, default=1.0, help="multiplies --duration")
    p.add_argument("--low-rate", type=float, default=0.15, help="streams/s at the ends")
    p.add_argument("--high-rate", type=float, default=0.5, help="streams/s in the high phase")
    p.add_argument("--stream-input", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    p.add_argument("--stream-outputs", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--burst-input", type=int, nargs=2, default=[1024, 2048], metavar=("MIN", "MAX"))
    p.add_argument("--burst-output", type=int, default=16)
    p.add_argument("--burst-size", type=int, default=2)
    p.add_argument("--burst-interval", type=float, default=30.0, help="s, in the high phase")
    p.add_argument("--slo-ttft", type=float, default=4.0, help="s (also the planner's target)")
    p.add_argument("--slo-tpot", type=float, default=0.25, help="s (also the planner's target)")
    p.add_argument("--max-workers", type=int, default=4, help="the autoscale arm's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default=",".join(ARMS), help="which, in this order (round 1)")
    p.add_argument(
        "--settle", type=float, default=35.0, help="s idle after the warm-up (planner window)"
    )
    p.add_argument(
        "--settle-max",
        type=float,
        default=240.0,
        help="s at most after the warm-up until the plan and workers are 1P1D",
    )
    p.add_argument("--log-dir", default=None, help="keep the clusters' logs here")
    p.add_argument(
        "--serve-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more pdserve serve flag for both arms (repeatable), e.g. "
        "--serve-flag=--num-kv-blocks=1024",
    )
    p.add_argument("--out", default=None, help="default: bench/results/autoscale_trace.json")
    p.add_argument("--replot", action="store_true", help="redraw the PNG and table from --out")
    args = p.parse_args(argv)
    args.duration *= args.duration_scale
    if args.rounds < 1 or not args.duration > 0 or not 0 < args.low_rate <= args.high_rate:
        p.error("--rounds >= 1, a positive duration and 0 < --low-rate <= --high-rate")
    if not args.arms or not set(args.arms.split(",")) <= set(ARMS):
        p.error(f"--arms: a comma-separated list of {', '.join(ARMS)}")
    return args


def default_out(model: str) -> Path:
    suffix = "" if model == "smollm2-135m-instruct" else f"_{Path(model).name}"
    return ROOT / f"bench/results/autoscale_trace{suffix}.json"


def run(args: argparse.Namespace, directory: Path) -> dict[str, list[dict[str, Any]]]:
    """Every round's figures per arm; the arms' order alternates between rounds."""
    maker = TokenPrompts(load_tokenizer(args.model_dir))
    rng = np.random.default_rng(args.seed + 99_999)  # warm-up prompts: none in any trace
    # one at a time, short: a long prompt's TTFT would pass the SLO and scale the cluster up
    warm = [BenchRequest(maker.text(64, rng), 16, 64, at=2.0 * k) for k in range(4)]
    arms = args.arms.split(",")
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for i in range(args.rounds):
        trace = build_trace(args, maker, args.seed + i)
        bursts = sum(r.kind == "burst" for r in trace)
        print(f"round {i + 1}: {len(trace)} requests ({bursts} long)", flush=True)
        for arm in arms if i % 2 == 0 else arms[::-1]:
            log = directory / f"{arm}-{i}.log"
            rounds[arm].append(run_arm(arm, args, trace, warm, log))
    return rounds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else default_out(args.model)
    if args.replot:
        draw(json.loads(out.read_text()), out)
        return 0
    from pdserve.models.store import resolve_model

    args.model_dir = str(resolve_model(args.model))
    load_before = os.getloadavg()
    started = time.monotonic()
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        rounds = run(args, Path(args.log_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="autoscale-trace-") as directory:
            rounds = run(args, Path(directory))
    command = shlex.join(
        [".venv/bin/python", "bench/experiments/autoscale_trace.py", *sys.argv[1:]]
    )
    machine: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    skip = ("out", "replot", "model_dir", "log_dir")
    trace = {k: v for k, v in vars(args).items() if k not in skip}
    trace["knots"] = [[f * args.duration, rate_at(f * args.duration, args)] for f, _ in KNOTS]
    report: dict[str, Any] = {"command": command, "model": Path(args.model).name, "trace": trace}
    report |= {"machine": machine, "minutes": (time.monotonic() - started) / 60}
    report |= {"results": summarize(rounds), "rounds": rounds}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print(f"wrote {out}")
    draw(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
