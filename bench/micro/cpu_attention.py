"""CPU decode attention: the torch path (gather + bmm) against the C kernel (engine/attention/
cpu_decode.c), side by side in one run, on a real model's shapes.

Two figures per (batch, context), each the median over ``--rounds`` rounds with the two paths
alternating within a round:

- attention: one layer's ``backend.forward`` (K/V write + attention), µs;
- step: a whole decode step through ``ModelRunner.execute`` (plan, 30 layers, logits), ms.

The KV cache holds random values (decode speed does not depend on them) in disjoint random
blocks, so no prefill runs. Every sequence of a batch has the same context length.

    .venv/bin/python bench/micro/cpu_attention.py                       # threads: torch's default
    .venv/bin/python bench/micro/cpu_attention.py --threads 1 --batches 1 8 --contexts 256
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVarTuple

import torch

from pdserve.engine.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.engine.attention.cpu_kernel import load_kernel
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.model_runner import ModelRunner, StepInputs

DEFAULT_MODEL = Path.home() / ".cache/pdserve/models/smollm2-135m-instruct"
CPU = torch.device("cpu")
Args = TypeVarTuple("Args")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="decode steps timed per round and path")
    p.add_argument("--layer-iters", type=int, default=20, help="layer calls per round and path")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    return p.parse_args()


def decode_batch(
    batch: int, context: int, num_blocks: int, bs: int, gen: torch.Generator
) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """(ids, positions, block tables, slots) of ``batch`` decode rows at ``context`` tokens."""
    per_seq = -(-context // bs)
    perm = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].tolist()
    tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    pos = context - 1
    slots = [t[pos // bs] * bs + pos % bs for t in tables]
    ids = torch.randint(0, 1000, (batch,), generator=gen).tolist()
    return ids, [pos] * batch, tables, slots


def timed(fn: Callable[[*Args], object], *args: *Args, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    return (time.perf_counter() - start) / iters


def measure(
    runner: ModelRunner,
    paths: dict[str, TorchAttentionBackend],
    batch: int,
    context: int,
    args: argparse.Namespace,
) -> list[float]:
    """Medians over rounds: [attention µs torch, kernel, step ms torch, kernel]."""
    bs, mcfg = args.block_size, runner.model.config
    heads, kv_heads, dim = mcfg.num_heads, mcfg.num_kv_heads, mcfg.head_dim
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    ids, pos, tables, slots = decode_batch(batch, context, runner.kv_cache.num_blocks, bs, gen)
    ids_t, pos_t, slot_t, rows = runner.buffers.load(ids, pos, slots, list(range(batch)))
    meta = AttentionMetadata(slot_t, [1] * batch, [context] * batch, tables, bs)
    inputs = StepInputs(ids_t, pos_t, meta, list(range(batch)), [], rows)
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=gen)
    q = qkv[:, : heads * dim].view(batch, heads, dim)  # strided, as the model's
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(batch, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(batch, kv_heads, dim)
    layer = (q, k, v, runner.kv_cache.layers[0], dim**-0.5)
    attn: dict[str, list[float]] = {name: [] for name in paths}
    step: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, backend in paths.items():
            backend.plan(meta)
            with torch.inference_mode():
                attn[name].append(timed(backend.forward, *layer, iters=args.layer_iters) * 1e6)
            runner.backend = backend
            runner.execute(inputs)  # warm
            step[name].append(timed(runner.execute, inputs, iters=args.steps) * 1e3)
    return [statistics.median(d[n]) for d in (attn, step) for n in paths]


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bs = args.block_size
    most = max(args.batches) * -(-max(args.contexts) // bs)
    config = EngineConfig(model=args.model, cache=CacheConfig(block_size=bs, num_blocks=most + 8))
    mcfg = ModelConfig.from_dir(args.model)
    runner = ModelRunner(config, mcfg, mcfg.max_model_len)
    gen = torch.Generator().manual_seed(0)
    for layer in runner.kv_cache.layers:
        layer.normal_(generator=gen)
    paths = {
        "torch": TorchAttentionBackend(CPU, cpu_kernel=False),
        "kernel": TorchAttentionBackend(CPU),
    }
    if load_kernel() is None:
        raise SystemExit("the CPU kernel did not build here (see the log)")
    print(
        f"{args.model}: {mcfg.num_layers} layers, {mcfg.num_heads}/{mcfg.num_kv_heads} heads, "
        f"head {mcfg.head_dim}, float32, block {bs}, {torch.get_num_threads()} threads, "
        f"medians of {args.rounds} rounds"
    )
    print(
        f"{'batch':>5} {'ctx':>5} | {'attn torch µs':>13} {'attn kernel µs':>14} {'x':>5} | "
        f"{'step torch ms':>13} {'step kernel ms':>14} {'x':>5}"
    )
    for batch in args.batches:
        for context in args.contexts:
            a_t, a_k, s_t, s_k = measure(runner, paths, batch, context, args)
            print(
                f"{batch:>5} {context:>5} | {a_t:>13.0f} {a_k:>14.0f} {a_t / a_k:>5.2f} | "
                f"{s_t:>13.2f} {s_k:>14.2f} {s_t / s_k:>5.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
