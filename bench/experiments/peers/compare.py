"""pdserve against llama.cpp's server and vLLM's CPU build on the same cores, in one run.

For each model, each round starts every server in turn (``servers.py``: vLLM float32,
llama.cpp on the model's GGUF, pdserve colocated float32 / int8 / int4 / GGUF-kept, pdserve
disaggregated), runs the same client (``pdserve bench``, random dataset, ``--ignore-eos``,
greedy, every request sent at once under ``--max-concurrency``) at each concurrency, and stops
it; rounds rotate the servers' order so drift on the machine hits all of them alike. Medians
over rounds, failed requests and connection resets per server go into
``bench/results/peers.json``, a markdown table (with pdserve int4 / llama.cpp and / vLLM) and a
PNG beside it.

    bench/experiments/peers/setup_vllm.sh                # once: vLLM in .peers/vllm
    bench/experiments/peers/setup_llamacpp.sh            # once: .peers/llamacpp/bin/llama-server
    .venv/bin/python bench/experiments/peers/compare.py --models smollm2-135m-instruct \
        --servers vllm llamacpp colocated colocated-int8 colocated-int4 colocated-gguf  # ~40 min
    .venv/bin/python bench/experiments/peers/compare.py --models small --rounds 1 --concurrency 8

Threads: every server gets the whole machine, each in the way it is best used: llama.cpp one
process with ``-t``/``-tb`` = all cores and ``-np`` = the largest concurrency; vLLM its default
(one compute thread here); pdserve its ``serve`` defaults (the cores split between its
workers, one thread each). llama.cpp and pdserve-GGUF serve ``<model dir>/model.gguf`` (or
``--gguf MODEL=PATH``); a model without one skips them. A benchmark, never part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any  # bench results and the report are JSON: values of every type

ROOT = Path(__file__).resolve().parents[3]

from pdserve.bench.experiments.peers.mbu import read_bandwidth, step_bytes  # noqa: E402
from pdserve.bench.experiments.peers.report import is_reset, plot, table  # noqa: E402
from pdserve.bench.experiments.peers.servers import (  # noqa: E402
    NEEDS_GGUF,
    SERVERS,
    WEIGHTS,
    start,
)
from pdserve.launch.worker_commands import pdserve_command  # noqa: E402

METRICS = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "p99_tpot_ms")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "small"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-client", type=int, default=3, help="requests = this x C")
    p.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    p.add_argument("--vllm-venv", default=str(ROOT / ".peers/vllm"))
    p.add_argument("--llama-server", default=str(ROOT / ".peers/llamacpp/bin/llama-server"))
    p.add_argument(
        "--gguf",
        nargs="*",
        default=[],
        metavar="MODEL=PATH",
        help="a GGUF for a model whose directory has no model.gguf",
    )
    p.add_argument("--out", default=str(ROOT / "bench/results/peers.json"))
    return p.parse_args()


def bench_once(url: str, model: str, c: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [*pdserve_command(), "bench", f"--base-url={url}", f"--tokenizer={model}"]
    cmd += ["--dataset=random", f"--random-input-len={args.input_len}"]
    cmd += [f"--random-output-len={args.output_len}", "--ignore-eos", "--temperature=0"]
    cmd += [f"--num-prompts={c * args.prompts_per_client}", f"--max-concurrency={c}"]
    cmd += ["--request-rate=inf", f"--warmup={min(c, 4)}", "--no-progress", f"--save-result={out}"]
    done = subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sys.stderr.write(done.stderr.decode(errors="replace"))
    saved = json.loads(out.read_text())  # one row as it is; a sweep as {"rows": [...]}
    row = saved["rows"][0] if "rows" in saved else saved
    # the warmup's failures count too (a server that resets connections does it there as well)
    warmup = re.search(rb"warmup: \d+ requests, (\d+) failed", done.stderr)
    return {
        **{k: row[k] for k in (*METRICS, "completed", "failed", "error_summary")},
        "warmup_failed": int(warmup.group(1)) if warmup else 0,
    }


def model_gguf(name: str, model: Path, args: argparse.Namespace) -> Path | None:
    """``--gguf NAME=PATH`` if given, else ``<model dir>/model.gguf`` if there, else None."""
    given = dict(item.split("=", 1) for item in args.gguf)
    path = Path(given[name]) if name in given else model / "model.gguf"
    return path if path.is_file() else None


def run_model(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from pdserve.models.store import resolve_model

    model = Path(resolve_model(name))
    gguf = model_gguf(name, model, args)
    servers = [s for s in args.servers if gguf is not None or s not in NEEDS_GGUF]
    if skipped := sorted(set(args.servers) - set(servers)):
        print(f"== {name}: no GGUF (model.gguf or --gguf), skipping {skipped}", flush=True)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        s: {c: [] for c in args.concurrency} for s in servers
    }
    for r in range(args.rounds):
        for server in servers[r % len(servers) :] + servers[: r % len(servers)]:
            print(f"== {name} round {r + 1}: {server}", flush=True)
            proc = start(server, model, gguf, args, tmp / f"{server}.log")
            try:
                for c in args.concurrency:
                    row = bench_once(proc.url, str(model), c, args, tmp / "row.json")
                    runs[server][c].append(row)
                    print(
                        f"   C={c:<3} {row['output_throughput']:8.1f} tok/s  median TPOT "
                        f"{row['median_tpot_ms']:6.1f} ms  failed {row['failed']} "
                        f"{row['error_summary'] or ''}",
                        flush=True,
                    )
            finally:
                proc.stop()
    out: dict[str, Any] = {
        s: {str(c): _median(rows) for c, rows in by_c.items()} for s, by_c in runs.items()
    }
    out["step_bytes"] = {s: step_bytes(model, WEIGHTS[s], gguf) for s in servers}
    out["gguf"] = None if gguf is None else str(gguf)
    return out


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds; requests, failures and their errors summed (never dropped)."""
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in METRICS}
    out["rounds"] = [r["output_throughput"] for r in rows]
    out["requests"] = sum(r["completed"] + r["failed"] for r in rows)
    out["failed"] = sum(r["failed"] for r in rows)
    out["warmup_failed"] = sum(r["warmup_failed"] for r in rows)
    errors: dict[str, int] = {}
    for r in rows:
        for err, n in r["error_summary"].items():
            errors[err] = errors.get(err, 0) + n
    out["errors"] = errors
    out["resets"] = sum(n for err, n in errors.items() if is_reset(err))
    return out


def main() -> int:
    args = parse_args()
    for server, binary, setup in (
        ("vllm", Path(args.vllm_venv) / "bin/vllm", "setup_vllm.sh"),
        ("llamacpp", Path(args.llama_server), "setup_llamacpp.sh"),
    ):
        if server in args.servers and not binary.exists():
            print(f"{binary} is missing: run bench/experiments/peers/{setup}", file=sys.stderr)
            return 2
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": shlex.join(
            [".venv/bin/python", "bench/experiments/peers/compare.py", *sys.argv[1:]]
        ),
        "workload": f"random {args.input_len} -> {args.output_len} tokens, ignore_eos, greedy, "
        f"{args.prompts_per_client} x C requests at concurrency C, medians of {args.rounds}",
        "concurrency": args.concurrency,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(),
            "read_bandwidth_gbs": {
                f"{t} thread(s)": read_bandwidth(t) / 1e9 for t in (1, os.cpu_count() or 1)
            },
        },
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            report["models"][name] = run_model(name, args, Path(tmp))
    report["machine"]["loadavg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    text = table(report)
    out.with_suffix(".md").write_text(f"{report['command']}\n\n{report['workload']}\n\n{text}\n")
    plot(report, out.with_suffix(".png"))
    print(text)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
