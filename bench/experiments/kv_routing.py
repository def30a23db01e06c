"""KV-aware routing against load-based routing, on the ``multi-turn`` chat workload.

Starts ``pdserve serve --prefill 2 --decode 2 --pin --routing MODE
--max-local-prefill-tokens 128`` for each arm (on this 2-core machine: a prefill and a decode
worker pinned to each core; with ``kv`` a turn whose history its decode worker holds is
prefilled there, its few new tokens only, and nothing moves), alternating the arms
round by round (kv, load, load, kv, kv, ...: neither always goes first on a warmer or quieter
machine), and runs ``pdserve bench --dataset multi-turn`` against each: conversations that
re-send their history over a shared system prompt. Round r uses seed ``--seed + r`` for both
arms, so each pair of runs sends the same conversations.

Per run it keeps turns >= 3 (``per_turn["3+"]``): median TTFT, median TPOT, prompt and cached
prompt tokens (``usage.prompt_tokens_details.cached_tokens``: the larger of the prefill
worker's prefix-cache hit and the decode worker's, which holds the earlier answers too), and
prompt - cached; and from the gateway's ``/metrics`` the coordinator's routing decisions and
the workers' own totals over the whole run (every turn): prompt tokens computed (prefill and
decode workers), KV blocks and bytes moved.
The report gives each figure's median over the rounds per arm, and every run.

Writes ``bench/results/kv_routing[_MODEL].json`` (no suffix for ``small``), a markdown table
(``.md``) and a PNG beside it (``kv_routing_report.py``).

    .venv/bin/python bench/experiments/kv_routing.py                        # about 10 min
    .venv/bin/python bench/experiments/kv_routing.py --rounds 1 --conversations 8  # a smoke run

The JSON records the load average before and after each run: other processes on these two
cores show up as noise in every latency.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any  # a run's row is JSON, as the report file holds it

ROOT = Path(__file__).resolve().parents[2]

from pdserve.bench.experiments.cluster import ServeProcess  # noqa: E402
from pdserve.bench.experiments.kv_routing_report import ARMS, summary, write  # noqa: E402
from pdserve.launch.worker_commands import pdserve_command  # noqa: E402

TURN_KEYS = (
    "median_ttft_ms",
    "median_tpot_ms",
    "prompt_tokens",
    "cached_tokens",
    "completed",
    "requests",
)
WORKLOAD_KEYS = (
    "max_local_prefill_tokens",
    "conversations",
    "turns",
    "system_len",
    "user_len",
    "output_len",
    "concurrency",
    "warmup",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="model directory or name (or small)"
    )
    p.add_argument("--rounds", type=int, default=3, help="runs of each arm")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256, help="shared system prompt, tokens")
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-local-prefill-tokens",
        type=int,
        default=128,
        help="both arms: a turn whose part not cached on its decode worker is this short is "
        "prefilled there (with --routing load the coordinator knows no cache: never)",
    )
    p.add_argument("--serve-flag", action="append", default=[], help="extra pdserve serve flag")
    p.add_argument("--out", default=None, help="default: bench/results/kv_routing_MODEL.json")
    p.add_argument("--replot", action="store_true", help="redraw the PNG and table from --out")
    return p.parse_args()


def model_dir(name: str) -> str:
    """A directory for ``--model`` (pulling or making it on first use)."""
    from pdserve.models.store import resolve_model

    return resolve_model(name)


def default_out(name: str) -> Path:
    suffix = "" if name == "small" else f"_{Path(name).name}"
    return ROOT / f"bench/results/kv_routing{suffix}.json"


def bench_flags(args: argparse.Namespace, model: str, seed: int) -> list[str]:
    return [
        "--dataset=multi-turn",
        f"--tokenizer={model}",
        f"--multi-turn-conversations={args.conversations}",
        f"--multi-turn-turns={args.turns}",
        f"--multi-turn-system-len={args.system_len}",
        f"--multi-turn-user-len={args.user_len}",
        f"--multi-turn-output-len={args.output_len}",
        f"--max-concurrency={args.concurrency}",
        "--request-rate=inf",
        "--ignore-eos",
        "--temperature=0",
        f"--warmup={args.warmup}",
        f"--seed={seed}",
        "--no-progress",
    ]


def metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        body: bytes = r.read()  # urlopen's response is untyped
        return body.decode()


def routing_decisions(text: str) -> dict[str, float]:
    """``pdserve_routing_decisions_total`` by reason, from the gateway's ``/metrics``."""
    found = re.findall(r'pdserve_routing_decisions_total\{reason="([a-z_]+)"\} ([0-9.e+]+)', text)
    return {reason: float(value) for reason, value in found}


def worker_total(text: str, name: str) -> float:
    """``pdserve_worker_NAME_total`` summed over every worker."""
    found = re.findall(rf"^pdserve_worker_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def settled_metrics(url: str, timeout: float = 15.0) -> str:
    """``/metrics`` once the workers' totals stop changing: each reaches the gateway with the
    worker's next heartbeat (about a second), through the coordinator."""
    deadline, text = time.monotonic() + timeout, metrics(url)
    while time.monotonic() < deadline:
        time.sleep(1.2)
        again = metrics(url)
        names = ("prefill_tokens", "kv_bytes_sent")
        if all(worker_total(again, n) == worker_total(text, n) for n in names):
            return again
        text = again
    return text


def run_arm(args: argparse.Namespace, model: str, arm: str, seed: int, out: Path) -> dict[str, Any]:
    print(f"== {arm} (seed {seed}): starting pdserve serve", flush=True)
    flags = ["--prefill=2", "--decode=2", "--pin", f"--routing={arm}"]
    flags += [f"--max-local-prefill-tokens={args.max_local_prefill_tokens}", *args.serve_flag]
    load_before = os.getloadavg()
    cluster = ServeProcess(model, flags)
    try:
        cmd = [*pdserve_command(), "bench", f"--base-url={cluster.url}"]
        cmd += [*bench_flags(args, model, seed), f"--save-result={out}"]
        subprocess.run(cmd, check=True)
        text = settled_metrics(cluster.url)
    finally:
        cluster.stop()
    result = json.loads(out.read_text())
    # (none with --turns 2: a run to subtract from a longer one's totals gives turns 3+ alone)
    turns = result["per_turn"].get("3+") or dict.fromkeys(TURN_KEYS, 0)
    cached = turns["cached_tokens"] or 0
    return {
        "arm": arm,
        "seed": seed,
        "ttft_p50_ms": turns["median_ttft_ms"],
        "tpot_p50_ms": turns["median_tpot_ms"],
        "prompt_tokens": turns["prompt_tokens"],
        "cached_tokens": cached,
        "cached_fraction": cached / turns["prompt_tokens"] if turns["prompt_tokens"] else 0.0,
        "computed_tokens": turns["prompt_tokens"] - cached,
        "completed": turns["completed"],
        "requests": turns["requests"],
        "failed": result["failed"],
        "routing": routing_decisions(text),
        # the workers' own totals over the whole run (warm-up and turns 1-2 included)
        "prefill_tokens": worker_total(text, "prefill_tokens"),
        "prefix_hit_tokens": worker_total(text, "prefix_hit_tokens"),
        "kv_blocks_sent": worker_total(text, "kv_blocks_sent"),
        "kv_mb_sent": worker_total(text, "kv_bytes_sent") / 1e6,
        "loadavg": [load_before, os.getloadavg()],
    }


def main() -> int:
    args = parse_args()
    out = Path(args.out) if args.out else default_out(args.model)
    if args.replot:
        write(json.loads(out.read_text()), out)
        return 0
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    model = model_dir(args.model)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ARMS if r % 2 == 0 else ARMS[::-1]
            for arm in order:
                path = Path(tmp) / f"{arm}-{r}.json"
                runs.append(run_arm(args, model, arm, args.seed + r, path))
    command = shlex.join([".venv/bin/python", "bench/experiments/kv_routing.py"])
    command += "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    report = {
        "command": command,
        "bench_command": shlex.join(
            ["pdserve", "bench", "--base-url=URL", *bench_flags(args, "MODEL", args.seed)]
        ),
        "model": Path(args.model).name,
        "workload": {key: getattr(args, key) for key in WORKLOAD_KEYS},
        "machine": {"cpus": os.cpu_count()},
        "median": summary(runs),
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    write(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
