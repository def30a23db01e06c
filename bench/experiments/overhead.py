"""What the serving path costs: generated tokens/s through HTTP → gateway → coordinator →
prefill → KV transfer → decode → SSE, against the in-process engine, same model and load.

Both sides run the same N random-token prompts (completions with token-id prompts, greedy,
``ignore_eos``) all at once; the cluster is ``pdserve serve`` (1 prefill + 1 decode, cores
split between them) started by this script, the engine gets every core. Prints both figures
and their ratio (aim: >= 0.8).

    .venv/bin/python bench/experiments/overhead.py                  # small model, 32 streams
    .venv/bin/python bench/experiments/overhead.py --model DIR --streams 8 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from pdserve.bench.client import sse_lines
from pdserve.bench.experiments.cluster import ServeProcess


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: built-in small)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--mode", default="disagg", choices=["disagg", "colocated"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def in_process(model: str, prompts: list[list[int]], output_len: int, threads: int) -> float:
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.protocol.sampling import SamplingParams

    config = EngineConfig(model=model, threads=threads, cache=CacheConfig(kv_cache_memory=1 << 30))
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.new_token_ids) for o in outs) / elapsed


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> int:
    tokens = 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in sse_lines(r):
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


async def through_http(base: str, model: str, prompts: list[list[int]], output_len: int) -> float:
    url = f"{base}/v1/completions"

    def body(p: list[int], n: int) -> dict[str, object]:
        return {
            "model": model,
            "prompt": p,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async with httpx.AsyncClient(timeout=600) as client:
        await _stream(client, url, body(prompts[0], 2))  # warm up
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(client, url, body(p, output_len)) for p in prompts))
        elapsed = time.perf_counter() - start
    if counts != [output_len] * len(prompts):
        raise SystemExit(f"streams came back short: {counts}")
    return sum(counts) / elapsed


def main() -> None:
    args = parse_args()
    import random

    from pdserve.models.make_model import default_model_dir

    model = args.model or str(default_model_dir("small"))
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, 2000) for _ in range(args.input_len)] for _ in range(args.streams)
    ]
    cluster = ServeProcess(model, [f"--mode={args.mode}", "--kv-cache-memory=512M"])
    try:
        http_tps = asyncio.run(
            through_http(cluster.url, Path(model).name, prompts, args.output_len)
        )
    finally:
        cluster.stop()
    cores = os.cpu_count() or 1
    worker_threads = max(1, cores // 2)  # what `pdserve serve` gives each of its 2 workers
    rows = [
        (f"in-process engine, {cores} threads", in_process(model, prompts, args.output_len, cores)),
        (
            f"in-process engine, {worker_threads} thread(s) (= a worker)",
            in_process(model, prompts, args.output_len, worker_threads),
        ),
    ]
    print(
        f"model {model}  streams {args.streams}  input {args.input_len}  output "
        f"{args.output_len}  cores {cores}  mode {args.mode}"
    )
    print(f"{'path':<44} {'tokens/s':>9} {'HTTP / this':>12}")
    for name, tps in rows:
        print(f"{name:<44} {tps:>9.1f} {http_tps / tps:>12.2f}")
    print(f"{'HTTP through pdserve serve':<44} {http_tps:>9.1f}")


if __name__ == "__main__":
    main()
