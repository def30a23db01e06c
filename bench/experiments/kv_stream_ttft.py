"""Does offering a prompt's KV chunk by chunk (``--kv-stream-chunks``) pay? TTFT and the time
to token 1 of a long prompt through 1P1D over nixl, the flag off (A) and on (B).

    .venv/bin/python bench/experiments/kv_stream_ttft.py [--model smollm2-135m-instruct]
        [--tokens 4096] [--rounds 5] [--chunk 256] [--out bench/results/kv_stream_ttft.json]

Both clusters (``pdserve serve``, checksums on as by default) run at once, the idle one costing
next to nothing, and take turns, A B A B ..., after one warm-up request each; every request is a
fresh random prompt (no prefix-cache hit) with ``max_tokens`` 2. TTFT: the first streamed token
at the client, token 0, which the prefill worker sends before any transfer ends; token 1: the
second, the first the decode worker made after the KV arrived, where streaming can win; token 1
after TTFT: that gain without the prefill's own time to blur it; transfer: the prefill worker's
figure (``transfer_ttft.transfer_totals``: from its last offer until every offer was read).
Both take chunks of ``--chunk`` tokens (no step-budget calibration: it times dummy steps at
start-up, and two clusters calibrated apart would chunk, and so compute, differently). The
machine is shared, so each figure is printed as a median with its range, and the per-round
difference B - A likewise.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from pdserve.bench.experiments.cluster import ServeProcess
from pdserve.bench.experiments.transfer_ttft import one_request, transfer_totals

ARMS = {"off": [], "on": ["--kv-stream-chunks"]}
FIGURES = ("ttft_s", "to_token1_s", "token1_after_ttft_s", "transfer_s")


def measure(url: str, model: str, prompt: list[int]) -> dict[str, float]:
    """One request's TTFT, time to token 1, and the prefill worker's transfer seconds."""
    s0, c0 = transfer_totals(url)
    ttft, token1 = one_request(url, model, prompt)
    deadline = time.monotonic() + 10  # the figure comes with the next heartbeat
    while (totals := transfer_totals(url))[1] < c0 + 1:
        if time.monotonic() > deadline:
            raise RuntimeError("no transfer counted")
        time.sleep(0.2)
    return {
        "ttft_s": ttft,
        "to_token1_s": token1,
        "token1_after_ttft_s": token1 - ttft,
        "transfer_s": (totals[0] - s0) / (totals[1] - c0),
    }


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens a step computes")
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    common = [
        "--transfer-backend=nixl",
        "--num-kv-blocks=640",  # two 4,096-token prompts' worth and more
        "--transfer-timeout=600",  # a long prompt's prefill runs within it
        f"--max-num-batched-tokens={args.chunk}",
        "--max-step-time=0",
    ]
    clusters = {arm: ServeProcess(args.model, [*common, *flags]) for arm, flags in ARMS.items()}
    try:
        model = httpx.get(f"{clusters['off'].url}/v1/models", timeout=30).json()["data"][0]["id"]
        rng = random.Random(11)

        def prompt() -> list[int]:
            return [rng.randrange(100, 40000) for _ in range(args.tokens)]

        for serve in clusters.values():
            measure(serve.url, model, prompt())  # warm-up
        rounds: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
        for i in range(args.rounds):
            for arm, serve in clusters.items():  # A B, A B, ...
                rounds[arm].append(measure(serve.url, model, prompt()))
                print(
                    f"round {i + 1} {arm:3}: "
                    + "  ".join(f"{k} {v:.3f}" for k, v in rounds[arm][-1].items()),
                    flush=True,
                )
    finally:
        for serve in clusters.values():
            serve.stop()
    results = {arm: {f: summary([r[f] for r in rs]) for f in FIGURES} for arm, rs in rounds.items()}
    diffs = {
        f: summary([b[f] - a[f] for a, b in zip(rounds["off"], rounds["on"], strict=True)])
        for f in FIGURES
    }
    print(f"\n{args.tokens}-token prompts, {args.model}, 1P1D nixl, {args.rounds} rounds each")
    print(f"{'':22}{'off':>24}{'on':>24}{'on - off':>24}")
    for f in FIGURES:
        cells = [results["off"][f], results["on"][f], diffs[f]]
        row = "".join(f"{c['median']:9.3f} [{c['min']:6.3f}, {c['max']:6.3f}]" for c in cells)
        print(f"{f:22}{row}")
    if args.out:
        record = {"args": vars(args), "rounds": rounds, "results": results, "on_minus_off": diffs}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
