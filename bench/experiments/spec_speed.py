"""Speculative decoding on this machine (issue 39): SmolLM2-135M-Instruct in float32, served by
one colocated worker on every core, without speculation, with n-gram drafts and with an int4
copy of itself drafting, on copy-heavy and on chat prompts at 1, 8 and 32 streams.

    python -m bench.experiments.spec_speed [--rounds 3] [--streams 1,8,32] [--max-tokens 128]
        [--arms off,ngram,draft] [--out bench/results/spec_speed]

One cluster an arm, ``pdserve serve --mode colocated --prefill 0 --decode 1 --threads CPUS
--quantization none --max-num-seqs 64 --num-kv-blocks N`` (N: 32 streams of 900 tokens, and
a quarter more), plus::

    off    --speculative off
    ngram  --speculative ngram                   drafts looked up in the prompt and output
    draft  --speculative draft --draft-model smollm2-135m-instruct --draft-quantization int4

(``--spec-switch auto``: the worker's step-time model decides each step). The clusters start
one after another (each worker probes its step time at start-up on a quiet machine), are
warmed up (``--warmup`` full-length requests, 4 in flight) and stay up to the end; only one is
ever under load. Round r runs each workload at each stream count on off, ngram, draft in turn,
so a slow spell of the host hits every arm alike. About 25 min on a 2-core host (printed).

Workloads (chat endpoint, temperature 0, the same requests for every arm and round):

    copy   passages of 150-300 words of the project's own text (README.md, ../shared/DESIGN.md,
           bench/README.md, module docstrings) to repeat exactly, fix the typos in, put one
           sentence a line, or continue: outputs that copy their prompt
    chat   40 open questions: drafts mostly miss

Neither sets ``ignore_eos`` (``--chat-ignore-eos`` does for chat): the questions ask for long
answers (126 tokens of 128 on average), and past the end of one the model repeats itself,
which n-gram drafts would hit. At ``c`` streams ``c * R`` requests go out with exactly ``c`` in
flight (R = 4 at one stream, 3 below 32, 2 from 32). Per level: median TPOT ((last - first
token) / (tokens - 1)) and TTFT, output tokens/s; from the gateway's ``/metrics`` before and
after (once settled): drafts verified and accepted (each position's own rate), decode steps by
the switch's decision (speculated share), the mean engine step. Over rounds: medians, and
TPOT(off) / TPOT(arm) and tokens/s(arm) / tokens/s(off) per round, their median and min-max.

Prints a line per level, then a table per workload and the issue's aims (PASS / MISS, not
asserted: 1 stream copy ngram TPOT >= 1.8x lower than off; chat no arm over 5% slower than
off; 32 streams tokens/s within 5% of off); writes ``<out>.json`` (every round's figures) and
``<out>.md`` (the tables, with the host, model, date and flags).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import math
import os
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any  # rounds and the report are JSON

import numpy as np

from pdserve.bench.client import Target, first_model
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.experiments.cluster import ROOT, ServeProcess
from pdserve.bench.experiments.spec_speed_report import (
    WORKLOADS,
    aims,
    cpu_model,
    fmt,
    markdown,
    summarize,
)
from pdserve.bench.experiments.spec_workloads import (
    project_passages,
    requests_per_stream,
    workload,
)
from pdserve.bench.metrics import RequestOutput, metric_values
from pdserve.bench.runner import RunSpec, make_client, run_requests

MODEL = "smollm2-135m-instruct"
ARMS = {
    "off": ["--speculative=off"],
    "ngram": ["--speculative=ngram"],
    "draft": ["--speculative=draft", f"--draft-model={MODEL}", "--draft-quantization=int4"],
}
KV_STREAMS, KV_TOKENS, BLOCK_SIZE = 32, 900, 16
EST_STEP_S, EST_STEP_PER_STREAM_S, EST_PREFILL_TOKEN_S = 0.022, 0.0012, 0.0015  # 2 cores, fp32


def serve_flags(arm: str, threads: int) -> list[str]:
    blocks = math.ceil(KV_STREAMS * KV_TOKENS / BLOCK_SIZE * 1.25)
    flags = ["--mode=colocated", "--prefill=0", "--decode=1", f"--threads={threads}"]
    flags += ["--quantization=none", f"--num-kv-blocks={blocks}", "--max-num-seqs=64"]
    return flags + ARMS[arm]


# ---- /metrics --------------------------------------------------------------------------------

SPEC_LINE = re.compile(
    r"^pdserve_worker_(spec_drafted_tokens_total|spec_accepted_tokens_total|spec_steps_total|"
    r"spec_draft_tokens_total|step_seconds_count|step_seconds_sum)\{([^}]*)\} (\S+)$",
    re.M,
)


def spec_counters(text: str) -> dict[str, float]:
    """Every worker's totals summed: ``drafted:P`` / ``accepted:P`` (position P), ``steps:R``
    (reason R), ``draft_tokens``, ``steps:all`` (every engine step) and ``steps:seconds``
    (their time)."""
    out: dict[str, float] = {}
    for name, labels, value in SPEC_LINE.findall(text):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if name.startswith("step_seconds_"):
            key = "steps:all" if name.endswith("count") else "steps:seconds"
        elif name == "spec_steps_total":
            key = f"steps:{tags.get('reason', '?')}"
        elif name == "spec_draft_tokens_total":
            key = "draft_tokens"
        else:
            key = f"{name.split('_')[1]}:{tags.get('position', '?')}"
        out[key] = out.get(key, 0.0) + float(value)
    return out


def spec_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What a level did: drafts and acceptances by position, decode steps by decision."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    positions = sorted(int(k.split(":")[1]) for k in delta if k.startswith("drafted:"))
    drafted = [delta[f"drafted:{p}"] for p in positions]
    accepted = [delta.get(f"accepted:{p}", 0.0) for p in positions]
    steps = {
        k.split(":")[1]: v
        for k, v in delta.items()
        if k.startswith("steps:") and k not in ("steps:all", "steps:seconds")
    }
    decisions, engine_steps = sum(steps.values()), delta.get("steps:all", 0.0)
    return {
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": sum(accepted) / sum(drafted) if sum(drafted) else None,
        "steps": steps,
        "speculated_share": steps.get("speculated", 0.0) / decisions if decisions else None,
        "engine_steps": engine_steps,
        "mean_step_ms": delta.get("steps:seconds", 0.0) / engine_steps * 1e3
        if engine_steps
        else None,
        "draft_tokens": delta.get("draft_tokens", 0.0),
    }


def settled(cluster: ServeProcess, timeout_s: float = 15.0) -> dict[str, float]:
    """The counters once two reads 1.2 s apart agree: a worker's totals reach the gateway with
    its next heartbeat (1 s) and the gateway's next hello to the coordinator."""
    time.sleep(2.2)
    deadline, last = time.monotonic() + timeout_s, spec_counters(cluster.metrics())
    while time.monotonic() < deadline:
        time.sleep(1.2)
        now = spec_counters(cluster.metrics())
        if now == last:
            return now
        last = now
    return last


# ---- running ---------------------------------------------------------------------------------


def cpu_seconds() -> tuple[float, float] | None:
    """CPU seconds so far of the whole host and of this process's live tree (the clusters):
    what other processes took during a level is the difference of the differences. Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        parent: dict[int, int] = {}
        used: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:  # gone meanwhile
                    continue
                parent[int(entry.name)] = int(stat[1])
                used[int(entry.name)] = int(stat[11]) + int(stat[12])  # utime + stime
    except (OSError, ValueError, IndexError):
        return None
    ours, me = 0, os.getpid()
    for pid in used:
        up = pid
        while up > 1 and up != me:
            up = parent.get(up, 0)
        ours += used[pid] if up == me else 0
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - fields[3] - fields[4]) / tick, ours / tick  # busy: not idle, iowait


def other_share(before: tuple[float, float] | None, seconds: float) -> float | None:
    """The share of the host's cores other processes kept busy since ``before``."""
    after = cpu_seconds()
    if before is None or after is None or seconds <= 0:
        return None
    other = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, other) / (seconds * (os.cpu_count() or 1))


@dataclass
class Arm:
    name: str
    cluster: ServeProcess
    model: str  # the served id
    counters: dict[str, float]  # /metrics as last read


async def drive(
    url: str, model: str, requests: list[BenchRequest], streams: int, ignore_eos: bool
) -> tuple[list[RequestOutput], float]:
    """The requests, exactly ``streams`` in flight (a closed loop): outputs, duration."""
    target = Target(
        url, "/v1/chat/completions", model=model, ignore_eos=ignore_eos, temperature=0.0
    )
    async with make_client(900) as client:
        return await run_requests(client, target, requests, RunSpec(max_concurrency=streams))


async def served_model(url: str) -> str:
    async with make_client(30) as client:
        return await first_model(client, url, None)


def start(arm: str, model_dir: str, threads: int, warm: list[BenchRequest], log: Path) -> Arm:
    print(f"== {arm}: starting pdserve serve {shlex.join(serve_flags(arm, threads))}", flush=True)
    cluster = ServeProcess(model_dir, serve_flags(arm, threads), log=log, ready_timeout_s=600)
    try:
        model = asyncio.run(served_model(cluster.url))
        outputs, _ = asyncio.run(drive(cluster.url, model, warm, 4, False))
        if failed := [o.error for o in outputs if not o.success]:
            raise RuntimeError(f"{arm}: warm-up requests failed: {failed[:3]}")
        return Arm(arm, cluster, model, settled(cluster))
    except BaseException:
        cluster.stop()
        raise


def measure(
    arm: Arm, requests: list[BenchRequest], streams: int, ignore_eos: bool
) -> dict[str, Any]:
    load, cpu = os.getloadavg()[0], cpu_seconds()
    outputs, duration = asyncio.run(
        drive(arm.cluster.url, arm.model, requests, streams, ignore_eos)
    )
    others = other_share(cpu, duration)
    after = settled(arm.cluster)
    spec = spec_figures(arm.counters, after)
    arm.counters = after
    done = [o for o in outputs if o.success]
    tokens = sum(o.output_tokens for o in done)
    tpots, ttfts = metric_values(outputs, "tpot"), metric_values(outputs, "ttft")
    return {
        "tpot_ms": statistics.median(tpots) * 1e3 if tpots else None,
        "p90_tpot_ms": float(np.percentile(tpots, 90)) * 1e3 if tpots else None,
        "ttft_ms": statistics.median(ttfts) * 1e3 if ttfts else None,
        "tokens_per_s": tokens / duration if duration else 0.0,
        "output_tokens": tokens,
        "mean_output_tokens": tokens / len(done) if done else 0.0,
        "requests": len(outputs),
        "failed": len(outputs) - len(done),
        "errors": sorted({o.error for o in outputs if not o.success})[:3],
        "duration_s": duration,
        "loadavg": [load, os.getloadavg()[0]],
        "other_cpu_share": others,
        **spec,
    }


def estimate_s(streams: list[int], max_tokens: int, rounds: int, arms: int) -> float:
    """A rough whole-run time, from a 2-core host's speed without speculation."""
    level = 0.0
    for c in streams:
        n = c * requests_per_stream(c)
        decode = n / c * max_tokens * (EST_STEP_S + EST_STEP_PER_STREAM_S * c)
        # both workloads' decodes, the copy prompts (~400 tokens), two settles of /metrics
        level += 2 * decode + n * 400 * EST_PREFILL_TOKEN_S + 2 * 3.5
    return level * arms * rounds * 2 / (os.cpu_count() or 1) + arms * 40


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", default="1,8,32", help="concurrency levels, comma-separated")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS)}, in this order")
    p.add_argument(
        "--warmup", type=int, default=8, help="requests per cluster before measuring, 4 at once"
    )
    p.add_argument(
        "--chat-ignore-eos", action="store_true", help="chat answers run to --max-tokens"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-dir", type=Path, default=None, help="the clusters' logs (default: a temp dir)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench/results/spec_speed",
        help="writes OUT.json, OUT.md",
    )
    args = p.parse_args(argv)
    args.arms = args.arms.split(",")
    args.streams = [int(c) for c in args.streams.split(",")]
    if unknown := [a for a in args.arms if a not in ARMS]:
        p.error(f"unknown arms {unknown}: choose from {list(ARMS)}")
    if args.rounds < 1 or min(args.streams) < 1 or args.max_tokens < 2:
        p.error("--rounds >= 1, streams >= 1 and --max-tokens >= 2")
    return args


def log_problems(log: Path) -> list[str]:
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return [line for line in lines if re.search(r"\b(ERROR|CRITICAL|Traceback)\b", line)]


def main(argv: list[str] | None = None) -> int:
    from pdserve.models.store import resolve_model

    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the clusters still stop
    threads = os.cpu_count() or 1
    model_dir = str(resolve_model(MODEL))
    found = project_passages(ROOT)
    if not found:
        raise SystemExit("no passages of 150-300 words found in the project's text")
    levels = {
        (w, c): workload(w, found, c * requests_per_stream(c), args.max_tokens, args.seed + i)
        for i, (w, c) in enumerate((w, c) for w in WORKLOADS for c in args.streams)
    }
    half = max(1, args.warmup // 2)
    # full-length answers, so the worker's step-time model and acceptance see real steps
    warm = workload("copy", found, half, args.max_tokens, args.seed + 1000)
    warm += workload("chat", [], half, args.max_tokens, args.seed + 1000)
    sha = hashlib.sha256(json.dumps([[r.messages for r in rs] for rs in levels.values()]).encode())
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="spec_speed_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    est = estimate_s(args.streams, args.max_tokens, args.rounds, len(args.arms))
    print(
        f"{len(found)} passages; {len(args.arms)} arms x {len(WORKLOADS)} workloads x streams "
        f"{args.streams} x {args.rounds} rounds: roughly {est / 60:.0f} min; logs in {log_dir}",
        flush=True,
    )
    load_before, t0 = os.getloadavg()[0], time.monotonic()
    arms: dict[str, Arm] = {}
    runs: list[dict[str, Any]] = []
    try:
        for a in args.arms:  # one after another: each probes its step time on a quiet machine
            arms[a] = start(a, model_dir, threads, warm, log_dir / f"{a}.log")
        started = time.monotonic()
        for rnd in range(args.rounds):
            for w in WORKLOADS:
                for c in args.streams:
                    for a in args.arms:  # only one arm under load at a time
                        ignore_eos = w == "chat" and args.chat_ignore_eos
                        row = measure(arms[a], levels[(w, c)], c, ignore_eos)
                        runs.append({"round": rnd, "arm": a, "workload": w, "streams": c, **row})
                        print(
                            f"round {rnd + 1} {w} {c:>2} streams {a:>5}: TPOT "
                            f"{fmt(row['tpot_ms'], '{:.1f}')} ms, {row['tokens_per_s']:.1f} tok/s, "
                            f"acceptance {fmt(row['acceptance'], '{:.0%}')}, speculated "
                            f"{fmt(row['speculated_share'], '{:.0%}')}, engine step "
                            f"{fmt(row['mean_step_ms'], '{:.1f}')} ms, {row['requests']} requests "
                            f"({row['failed']} failed) in {row['duration_s']:.1f} s, other "
                            f"processes {fmt(row['other_cpu_share'], '{:.0%}')} of the CPUs",
                            flush=True,
                        )
            spent = time.monotonic() - started
            print(
                f"-- round {rnd + 1} done at {(time.monotonic() - t0) / 60:.1f} min; about "
                f"{spent / (rnd + 1) * (args.rounds - rnd - 1) / 60:.1f} min to go",
                flush=True,
            )
    finally:
        for arm in arms.values():
            arm.cluster.stop()
    problems = {a: log_problems(log_dir / f"{a}.log") for a in args.arms}
    summary = summarize(runs, args.arms, args.streams)
    command = shlex.join(
        [".venv/bin/python", "-m", "bench.experiments.spec_speed", *(argv or sys.argv[1:])]
    )
    report: dict[str, Any] = {
        "command": command,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": {
            "cpus": threads,
            "cpu_model": cpu_model(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg()[0],
        },
        "model": MODEL,
        "flags": {a: serve_flags(a, threads) for a in args.arms},
        "rounds": args.rounds,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "chat_ignore_eos": args.chat_ignore_eos,
        "passages": len(found),
        "workload_sha256": sha.hexdigest(),
        "minutes": (time.monotonic() - t0) / 60,
        "summary": summary,
        "aims": aims(summary, args.streams),
        "log_problems": problems,
        "runs": runs,
    }
    text = markdown(report)
    print("\n" + text)
    for a, lines in problems.items():
        if lines:
            print(f"{a}: {len(lines)} ERROR/Traceback lines in its log; first: {lines[0]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    Path(f"{args.out}.md").write_text(text)
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
