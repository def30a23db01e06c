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
import ast
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
import subprocess
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
from pdserve.bench.metrics import RequestOutput, metric_values
from pdserve.bench.runner import RunSpec, make_client, run_requests

MODEL = "smollm2-135m-instruct"
ARMS = {
    "off": ["--speculative=off"],
    "ngram": ["--speculative=ngram"],
    "draft": ["--speculative=draft", f"--draft-model={MODEL}", "--draft-quantization=int4"],
}
WORKLOADS = ("copy", "chat")
KV_STREAMS, KV_TOKENS, BLOCK_SIZE = 32, 900, 16
INSTRUCTIONS = (  # (kind, weight, template): the copy workload's asks
    ("repeat", 2, "Repeat the following passage exactly, word for word:\n\n{}"),
    ("typos", 1, "Fix the typos in this passage and return it, otherwise unchanged:\n\n{}"),
    ("lines", 1, "Return this passage with each sentence on its own line:\n\n{}"),
    ("continue", 1, "Continue this text:\n\n{}"),
)
QUESTIONS = """\
Why is the sky blue?
How do vaccines train the immune system?
What makes a good teacher?
Explain how a bicycle stays upright.
What are the pros and cons of working from home?
How does a refrigerator keep food cold?
Describe the water cycle.
What should I pack for a week of hiking?
Why do leaves change colour in autumn?
How can I get better at public speaking?
What is the difference between weather and climate?
Write a short story about a lighthouse keeper.
How do airplanes fly?
What are some tips for learning a new language?
Explain photosynthesis to a ten-year-old.
Why is sleep important?
How does a credit score work?
What are black holes?
Suggest a plan for a rainy Sunday afternoon.
How do bees make honey?
What causes earthquakes?
Write a poem about the sea.
How should I prepare for a job interview?
What is the history of the printing press?
Why do cats purr?
How does recycling help the environment?
Explain what inflation is.
What are the benefits of regular exercise?
How do I make a simple tomato sauce?
Describe a day in the life of a medieval farmer.
What is machine learning?
How do tides work?
Give me advice on saving money.
Why did the Roman Empire fall?
How does the heart pump blood?
What makes a city pleasant to live in?
Explain how a compass works.
What are good habits for staying focused?
How are rainbows formed?
Describe how to plant a vegetable garden.
""".splitlines()  # the chat workload: open questions, long answers
AIM_COPY_SPEEDUP, AIM_SLOWDOWN, AIM_THROUGHPUT = 1.8, 1.05, 0.95
EST_STEP_S, EST_STEP_PER_STREAM_S, EST_PREFILL_TOKEN_S = 0.022, 0.0012, 0.0015  # 2 cores, fp32


def requests_per_stream(streams: int) -> int:
    return 4 if streams == 1 else 3 if streams < 32 else 2


def serve_flags(arm: str, threads: int) -> list[str]:
    blocks = math.ceil(KV_STREAMS * KV_TOKENS / BLOCK_SIZE * 1.25)
    flags = ["--mode=colocated", "--prefill=0", "--decode=1", f"--threads={threads}"]
    flags += ["--quantization=none", f"--num-kv-blocks={blocks}", "--max-num-seqs=64"]
    return flags + ARMS[arm]


# ---- the workloads ---------------------------------------------------------------------------


def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of prose in markdown or a docstring: no code, tables, headings or drawings."""
    out: list[str] = []
    block: list[str] = []
    fenced = False
    for line in [*text.splitlines(), ""]:
        s = line.strip()
        if s.startswith("```"):
            fenced = not fenced
        code = fenced or s.startswith(("```", "#", "|", "<")) or line.startswith(("    ", "\t"))
        if code or not s:
            para = " ".join(block)
            letters = sum(ch.isalpha() or ch.isspace() for ch in para)
            if len(para.split()) >= 12 and letters >= 0.8 * len(para):
                out.append(para)
            block = []
        else:
            block.append(s)
    return out


def passages(paragraphs: list[str], lo: int = 150, hi: int = 300) -> list[str]:
    """Runs of whole sentences of consecutive paragraphs, ``lo``-``hi`` words each, ending
    where a paragraph does when they can."""
    out: list[str] = []
    cur: list[list[str]] = []  # the passage's paragraphs, each a list of sentences
    words = 0
    for para in paragraphs:
        cur.append([])
        for sentence in re.split(r"(?<=[.!?])\s+", para):
            n = len(sentence.split())
            if words + n > hi:
                if words >= lo:
                    out.append("\n\n".join(" ".join(p) for p in cur if p))
                cur, words = [[]], 0
                if n > hi:
                    continue
            cur[-1].append(sentence)
            words += n
        if words >= lo:
            out.append("\n\n".join(" ".join(p) for p in cur if p))
            cur, words = [], 0
    return out


def project_passages(root: Path) -> list[tuple[str, str]]:
    """(source, passage) from the project's text: its READMEs, DESIGN.md, module docstrings."""
    docs = [root / "README.md", root.parent / "shared/DESIGN.md", root / "bench/README.md"]
    texts = [(os.path.relpath(p, root), p.read_text()) for p in docs if p.is_file()]
    for path in sorted(root.glob("*/**/*.py")):
        if path.parts[len(root.parts)].startswith((".", "tests")):
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text()))
        except (SyntaxError, UnicodeDecodeError):  # a file mid-edit
            continue
        if doc:
            texts.append((path.relative_to(root).as_posix(), doc))
    docstrings = "\n\n".join(text for src, text in texts if src.endswith(".py"))
    found = [
        (src, p)
        for src, text in texts
        if not src.endswith(".py")
        for p in passages(prose_paragraphs(text))
    ]
    found += [("docstrings", p) for p in passages(prose_paragraphs(docstrings))]
    return found


def add_typos(text: str, rng: np.random.Generator, share: float = 0.1) -> str:
    """Swaps two inner letters of about ``share`` of the words of four letters or more."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) >= 4 and word.isalpha() and rng.random() < share:
            j = int(rng.integers(1, len(word) - 2))
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    return " ".join(words)


def chat(text: str, max_tokens: int, kind: str) -> BenchRequest:
    message = {"role": "user", "content": text}
    return BenchRequest(text, max_tokens, len(text.split()), messages=(message,), kind=kind)


def copy_requests(
    found: list[tuple[str, str]], n: int, max_tokens: int, seed: int
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(found))
    weights = np.array([w for _, w, _ in INSTRUCTIONS], dtype=np.float64)
    out = []
    for i in range(n):
        _, text = found[order[i % len(found)]]
        kind, _, template = INSTRUCTIONS[
            int(rng.choice(len(INSTRUCTIONS), p=weights / weights.sum()))
        ]
        body = add_typos(text, rng) if kind == "typos" else text
        out.append(chat(template.format(body), max_tokens, f"copy-{kind}"))
    return out


def chat_requests(n: int, max_tokens: int, seed: int) -> list[BenchRequest]:
    order = np.random.default_rng(seed).permutation(len(QUESTIONS))
    return [chat(QUESTIONS[order[i % len(QUESTIONS)]], max_tokens, "chat") for i in range(n)]


def workload(
    name: str, found: list[tuple[str, str]], n: int, max_tokens: int, seed: int
) -> list[BenchRequest]:
    if name == "copy":
        return copy_requests(found, n, max_tokens, seed)
    return chat_requests(n, max_tokens, seed)


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
