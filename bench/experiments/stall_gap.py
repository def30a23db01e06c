"""How long do running streams wait while long prompts are prefilled beside them? One colocated
worker (``pdserve serve --mode colocated --prefill 0 --decode 1``: both cores), ``--streams``
streams decoding, then ``--prompts`` prompts of ``--prompt-len`` tokens sent at once. Each
round runs two arms, each on its own server:

    stall-free   --tpot-target-ms ``--tpot-target-ms``: a step carrying the streams adds only
                 the prompt tokens that fit the target
    stall        --tpot-target-ms 0: prompt chunks up to --max-step-time (0.5 s) a step

Per arm and round: the streams' inter-token gaps from the prompts' arrival until both have
their first token (at most ``--window`` s), as p50 / p99 / max, and the prompts' time to first
token (or "over the window"), and the worker's steps from ``/metrics`` (steps by kind, prompt
tokens, steps over the target by reason). Printed and saved as medians over rounds, each
round's figures kept (``--out``, default bench/results/stall_gap.json).

    .venv/bin/python bench/experiments/stall_gap.py --rounds 3    # about 10 min
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any  # an arm's row is JSON: figures, lists and the worker's steps

import httpx
import numpy as np

from pdserve.bench.experiments.cluster import ROOT, ServeProcess
from pdserve.bench.experiments.disagg_vs_colocated import worker_steps

VOCAB = (100, 40000)  # token ids drawn for prompts: within the model's vocabulary


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=2400)
    p.add_argument("--tpot-target-ms", type=float, default=150.0)
    p.add_argument("--window", type=float, default=40.0, help="seconds of gaps measured at most")
    p.add_argument("--out", default=str(ROOT / "bench/results/stall_gap.json"))
    return p.parse_args()


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


class Stream(threading.Thread):
    """One streamed completion; ``times`` of each chunk carrying text, ``first`` of the first."""

    def __init__(self, url: str, model: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        self.url = url
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with (
            httpx.Client(timeout=600) as client,
            client.stream("POST", f"{self.url}/v1/completions", json=self.body) as r,
        ):
            for line in r.iter_lines():
                if self.stop.is_set():
                    return  # closing the stream aborts the request
                if line.startswith("data:") and '"text"' in line:
                    self.times.append(time.monotonic())

    @property
    def first(self) -> float | None:
        return self.times[0] if self.times else None


def one_arm(args: argparse.Namespace, url: str, model: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    streams = [Stream(url, model, tokens(32, rng), 4000) for _ in range(args.streams)]
    for s in streams:
        s.start()
    while not all(len(s.times) >= 8 for s in streams):  # all decoding
        time.sleep(0.05)
    start = time.monotonic()
    prompts = [Stream(url, model, tokens(args.prompt_len, rng), 1) for _ in range(args.prompts)]
    for p in prompts:
        p.start()
    while time.monotonic() - start < args.window and not all(p.first for p in prompts):
        time.sleep(0.05)
    end = time.monotonic()
    for s in [*streams, *prompts]:
        s.stop.set()
    gaps = [
        b - a
        for s in streams
        for a, b in zip(s.times, s.times[1:], strict=False)
        if b > start and a < end
    ]
    ms = np.array(gaps) * 1e3
    ttft = [round((p.first - start) * 1e3) if p.first else None for p in prompts]
    return {
        "gap_p50_ms": float(np.percentile(ms, 50)),
        "gap_p99_ms": float(np.percentile(ms, 99)),
        "gap_max_ms": float(ms.max()),
        "gaps": len(gaps),
        "prompt_ttft_ms": ttft,  # None: not within the window
        "window_s": round(end - start, 2),
    }


def main() -> int:
    args = parse_args()
    from pdserve.models.store import resolve_model

    model_dir = resolve_model(args.model)
    arms = {
        "stall-free": [f"--tpot-target-ms={args.tpot_target_ms:g}"],
        "stall": ["--tpot-target-ms=0"],
    }
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for rnd in range(args.rounds):
        for arm, flags in arms.items():
            flags = ["--mode=colocated", "--prefill=0", "--decode=1", *flags]
            server = ServeProcess(model_dir, flags)
            try:
                got = one_arm(args, server.url, Path(args.model).name, seed=rnd)
                # the worker's steps since it started: kinds, prompt tokens, over-target reasons
                got["steps"] = worker_steps(server.metrics())
            finally:
                server.stop()
            runs[arm].append(got)
            print(f"round {rnd} {arm}: {json.dumps(got)}", flush=True)
    medians = {
        arm: {
            key: statistics.median(r[key] for r in rows)
            for key in ("gap_p50_ms", "gap_p99_ms", "gap_max_ms", "window_s")
        }
        for arm, rows in runs.items()
    }
    report = {"args": vars(args), "medians": medians, "rounds": runs}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for arm, m in medians.items():
        print(f"{arm}: " + ", ".join(f"{k} {v:.0f}" for k, v in m.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
