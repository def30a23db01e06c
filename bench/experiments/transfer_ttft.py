"""How much of a long prompt's TTFT is the KV transfer, per transfer backend (issue 24's aim:
under 5% for a 2,048-token prompt of the real model over nixl).

    .venv/bin/python bench/experiments/transfer_ttft.py [--model smollm2-135m-instruct]
        [--tokens 2048] [--rounds 5] [--backends zmq nixl]

For each backend: ``pdserve serve`` 1P1D (disaggregated, checksums on as by default), one
warm-up request, then ``--rounds`` streaming completions of ``--tokens`` distinct prompt tokens
(a fresh random prompt each round: no prefix-cache hit) with ``max_tokens`` 2. TTFT is the time
to the first streamed token at the client (the prefill worker sends token 0 before the
transfer); "to token 1" is the time to the second, the first the decode worker produced after
the KV arrived. Transfer seconds are the prefill worker's own figure
(``pdserve_worker_kv_transfer_seconds`` sum/count deltas in ``/metrics``: from handing the
blocks to the sender until the receiver took them). Prints medians.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time

import httpx

from pdserve.bench.experiments.cluster import ServeProcess

SUM = re.compile(r'^pdserve_worker_kv_transfer_seconds_sum\{role="prefill"[^}]*\} (\S+)$', re.M)
COUNT = re.compile(r'^pdserve_worker_kv_transfer_seconds_count\{role="prefill"[^}]*\} (\S+)$', re.M)


def transfer_totals(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(map(float, SUM.findall(text))), sum(map(float, COUNT.findall(text)))


def one_request(url: str, model: str, prompt: list[int]) -> tuple[float, float]:
    """(seconds to the first token, seconds to the second) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    marks: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                marks.append(time.perf_counter() - start)
    return marks[0], marks[1]


def run_backend(args: argparse.Namespace, backend: str) -> dict[str, float]:
    flags = [f"--transfer-backend={backend}", "--num-kv-blocks=2048"]
    serve = ServeProcess(args.model, flags)
    try:
        model = httpx.get(f"{serve.url}/v1/models", timeout=30).json()["data"][0]["id"]
        rng = random.Random(7)
        vocab = 40000

        def prompt() -> list[int]:
            return [rng.randrange(100, vocab) for _ in range(args.tokens)]

        one_request(serve.url, model, prompt())  # warm-up
        ttft, second, transfer = [], [], []
        for _ in range(args.rounds):
            s0, c0 = transfer_totals(serve.url)
            t0, t1 = one_request(serve.url, model, prompt())
            deadline = time.monotonic() + 10  # the figure comes with the next heartbeat
            while (totals := transfer_totals(serve.url))[1] < c0 + 1:
                if time.monotonic() > deadline:
                    raise RuntimeError("no transfer counted")
                time.sleep(0.2)
            ttft.append(t0)
            second.append(t1)
            transfer.append((totals[0] - s0) / (totals[1] - c0))
        med = statistics.median
        return {"ttft_s": med(ttft), "to_token1_s": med(second), "transfer_s": med(transfer)}
    finally:
        serve.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backends", nargs="+", default=["zmq", "nixl"])
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    results = {b: run_backend(args, b) for b in args.backends}
    print(f"{args.tokens}-token prompts, {args.model}, 1P1D, medians of {args.rounds}")
    print(f"{'backend':8} {'TTFT s':>8} {'token 1 s':>10} {'transfer s':>11} {'transfer/TTFT':>14}")
    for b, r in results.items():
        share = r["transfer_s"] / r["ttft_s"]
        print(
            f"{b:8} {r['ttft_s']:8.3f} {r['to_token1_s']:10.3f} {r['transfer_s']:11.4f} "
            f"{share:13.1%}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
