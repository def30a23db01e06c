"""What ``--kv-cache-dtype int8`` buys and costs on the real model, against the float32 cache.

- capacity: concurrent 2,048-token sequences (prompt and output together) whose KV fits the
  same memory (``--memory``), from the engine's own sizing (``KVCache.num_blocks_for``);
- TPOT: seconds of one decode step of 32 streams each with 1,024 tokens in the cache, on the
  engine in this process (``launch/profile.py``'s timed step); the blocks hold random values,
  written first (never-written blocks of the lazily zeroed cache all read one shared zero
  page, which would flatter the memory traffic). Each round times both caches, ``--steps``
  steps each (median); the figure is the median of ``--rounds`` rounds;
- transfer: bytes one 1,024-token prompt's blocks weigh (what a prefill worker pushes), and
  the milliseconds of a real zmq loopback transfer of them (median of 3);
- quality: ``quant_quality.py``'s measures (greedy agreement with float32 over its 24 prompts,
  mean |Δ logprob| teacher-forced on float32's continuations, perplexity of
  ``models/data/perplexity.txt`` in windows of ``--window`` tokens), the int8 cache against
  the float32 one, float32 weights both.

    .venv/bin/python bench/experiments/kv_int8.py            # ~3-4 minutes on 2 cores

Prints a table; writes ``bench/results/kv_int8.{json,md}``. Timings are of whatever machine
runs it (the stored ones: a 2-core host shared with other work).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.experiments.quant_quality import (
    PROMPTS,
    TEXT,
    ModeResult,
    run_mode,
    summarise,
)
from pdserve.engine.attention.kv_quant import quantize_rows
from pdserve.engine.block_manager import KVCache
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer import make_receiver, make_sender
from pdserve.kvtransfer.base import KVPoll, TransferSpec
from pdserve.launch.profile import Profiler
from pdserve.protocol.blocks import blocks_for
from pdserve.worker.wire import block_bytes

RESULTS = Path(__file__).resolve().parents[1] / "results"
KINDS = ("float32", "int8")  # the cache's form: --kv-cache-dtype auto (float32 model) | int8
BLOCK = 16


def make_engine(model: str, kind: str, num_blocks: int, threads: int | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            quantization="none",
            threads=threads,
            cache=CacheConfig(
                block_size=BLOCK,
                num_blocks=num_blocks,
                enable_prefix_caching=False,
                kv_cache_dtype="auto" if kind == "float32" else "int8",
            ),
            scheduler=SchedulerConfig(max_step_time_s=0),  # fixed chunking, no start-up timing
        )
    )


def capacity(cfg: ModelConfig, memory: int, seq_len: int) -> dict[str, dict[str, float]]:
    out = {}
    for kind in KINDS:
        kv = "auto" if kind == "float32" else "int8"
        cache = CacheConfig(block_size=BLOCK, kv_cache_memory=memory, kv_cache_dtype=kv)
        blocks = KVCache.num_blocks_for(cfg, cache, torch.float32, torch.device("cpu"))
        per_block = KVCache.bytes_per_block(cfg, BLOCK, torch.float32, cache.kv_cache_dtype)
        out[kind] = {
            "bytes_per_token": per_block / BLOCK,
            "blocks": blocks,
            "sequences": blocks // blocks_for(seq_len, BLOCK),
        }
    return out


def fill(engine: LLMEngine, num_blocks: int, seed: int) -> None:
    """Random K/V in the first ``num_blocks`` blocks of every layer (int8: quantized)."""
    g = torch.Generator().manual_seed(seed)
    for layer in engine.runner.kv_cache.layers:
        for start in range(0, num_blocks, 256):
            part = layer[start : min(start + 256, num_blocks)]
            if part.dtype == torch.int8:
                shape = (*part.shape[:-1], part.shape[-1] - 4)
                part.copy_(quantize_rows(torch.randn(shape, generator=g)))
            else:
                part.copy_(torch.randn(part.shape, generator=g))


def tpot(
    engines: dict[str, LLMEngine], streams: int, context: int, rounds: int, steps: int
) -> dict[str, list[float]]:
    """kind -> [median step seconds of each round]."""
    profilers = {k: Profiler(e, random.Random(0)) for k, e in engines.items()}
    out: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(rounds):
        for kind, prof in profilers.items():
            (_, _, seconds), *_ = prof.decode([streams], [context], steps)
            out[kind].append(seconds)
    return out


def transfer(engine: LLMEngine, tokens: int) -> dict[str, float]:
    """One prompt's blocks over zmq on loopback, into the same engine's other blocks."""
    layers = engine.runner.kv_cache.layers
    n = blocks_for(tokens, BLOCK)
    src, dst = list(range(n)), list(range(n, 2 * n))
    times = []
    with make_receiver("zmq", layers) as receiver, make_sender("zmq") as sender:
        for i in range(3):
            rid = f"t{i}"
            secret = receiver.expect(rid, dst, timeout_s=60)
            start = time.perf_counter()
            sender.send(TransferSpec(rid, src, dst, receiver.address, secret=secret), layers)
            while not receiver.poll(rid).finished:
                time.sleep(0.0005)
            times.append(time.perf_counter() - start)
            if receiver.poll(rid) is not KVPoll.DONE:
                raise RuntimeError(f"transfer failed: {receiver.failure_reason(rid)}")
            receiver.release(rid)
            sender.release(rid)
    return {"mb": n * block_bytes(engine) / 1e6, "ms": statistics.median(times) * 1e3}


def quality(model: str, threads: int | None, window: int, new_tokens: int) -> dict[str, Any]:
    from pdserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    prompts = [tok.encode(p) for p in PROMPTS]
    text = tok.encode(TEXT.read_text(encoding="utf-8"))
    results: dict[str, ModeResult] = {}
    for kind in KINDS:
        engine = make_engine(model, kind, 1024, threads)
        reference = results["float32"].greedy if results else None
        results[kind] = run_mode(engine, prompts, reference, text, window, new_tokens)
        del engine
    return summarise(results)


def table(report: dict[str, Any]) -> str:
    cap, t, mv, q = report["capacity"], report["tpot_s"], report["transfer"], report["quality"]
    rows = [
        ("KV bytes a token", *(f"{cap[k]['bytes_per_token']:,.0f}" for k in KINDS)),
        (
            f"2,048-token sequences in {report['memory_gib']:g} GiB",
            *(f"{cap[k]['sequences']:,}" for k in KINDS),
        ),
        (
            f"TPOT, {report['streams']} streams x {report['context']:,} tokens (ms)",
            *(f"{statistics.median(t[k]) * 1e3:.1f}" for k in KINDS),
        ),
        ("  rounds (ms)", *(" / ".join(f"{s * 1e3:.1f}" for s in t[k]) for k in KINDS)),
        ("KV MB per 1,024-token prompt", *(f"{mv[k]['mb']:.2f}" for k in KINDS)),
        ("  zmq loopback transfer (ms)", *(f"{mv[k]['ms']:.1f}" for k in KINDS)),
        ("perplexity", *(f"{q[k]['perplexity']:.4f}" for k in KINDS)),
        ("greedy prefix agreement", *(f"{q[k]['agreement']['prefix']:.1%}" for k in KINDS)),
        ("mean abs Δlogprob", *(f"{q[k]['logprob_mad']:.4f}" for k in KINDS)),
    ]
    lines = ["| | float32 KV | int8 KV |", "|---|---|---|"]
    return "\n".join([*lines, *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def main() -> None:
    from pdserve.models.store import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--memory", type=float, default=4.0, help="GiB of KV for the capacity line")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="decode steps timed per round")
    p.add_argument("--window", type=int, default=1024, help="perplexity window, tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "kv_int8")
    args = p.parse_args()
    model = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model)
    start = time.perf_counter()
    used = args.streams * blocks_for(args.context + 1, BLOCK)
    num_blocks = max(used, 2 * blocks_for(1024, BLOCK)) + 8  # the transfer's source and target
    engines = {k: make_engine(model, k, num_blocks, args.threads) for k in KINDS}
    for engine in engines.values():
        fill(engine, num_blocks, seed=1)
    report: dict[str, Any] = {
        "model": args.model,
        "host": "a shared 2-core machine (other work ran beside it): timings are indicative",
        "threads": torch.get_num_threads(),
        "memory_gib": args.memory,
        "streams": args.streams,
        "context": args.context,
        "capacity": capacity(cfg, int(args.memory * 2**30), 2048),
        "tpot_s": tpot(engines, args.streams, args.context, args.rounds, args.steps),
        "transfer": {k: transfer(e, 1024) for k, e in engines.items()},
    }
    del engines
    report["quality"] = quality(model, args.threads, args.window, args.new_tokens)
    report["seconds"] = time.perf_counter() - start
    text = table(report)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    note = f"{args.model}, float32 weights; {report['host']}, {report['threads']} threads.\n\n"
    args.out.with_suffix(".md").write_text(f"# int8 KV cache\n\n{note}{text}\n")
    print(f"wrote {args.out}.json and .md ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
