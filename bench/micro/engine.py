"""Offline throughput: the in-process engine against ``transformers.generate``, side by side.

For each concurrency C, the same C random prompts run (a) through pdserve's engine as one
continuously batched set and (b) through ``transformers.generate`` one request at a time, the
way a server without batching would serve them. Prints generated tokens/s of each and the
ratio, and checks that greedy tokens agree.

This is an engine benchmark, so unlike the client harness it imports torch and the engine.

    .venv/bin/python bench/micro/engine.py           # SmolLM2-135M, then the random small model
    .venv/bin/python bench/micro/engine.py --model tiny --concurrency 1 4 --output-len 32
    .venv/bin/python bench/micro/engine.py --quantization int4     # pdserve's int4 weights
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import torch

from pdserve.engine.config import QUANTIZATIONS, CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.models.store import DEFAULT_MODEL, resolve_model
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import GenerationMixin  # imported when a run needs it: it is slow


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        nargs="+",
        default=[DEFAULT_MODEL, "small"],
        help="model directories or names, one table each (default: the real model, then the "
        "random small one)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantization",
        default="none",
        choices=list(QUANTIZATIONS),
        help="pdserve's weights (transformers stays float32; quantized tokens may differ)",
    )
    p.add_argument("--quant-group-size", type=int, default=32)
    return p.parse_args()


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], output_len: int
) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - start, [o.new_token_ids for o in outs]


def run_transformers(
    model: GenerationMixin, prompts: list[list[int]], output_len: int
) -> tuple[float, list[list[int]]]:
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        tokens.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - start, tokens


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for model in args.model:
        bench_model(resolve_model(model), args)


def bench_model(model_dir: str, args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            dtype="float32",
            seed=args.seed,
            quantization=args.quantization,
            quant_group_size=args.quant_group_size,
            cache=CacheConfig(kv_cache_memory=1 << 30),
            scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048),
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.train(False)  # eval(), which transformers leaves unannotated
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    # warm both up once
    warm = [torch.randint(0, vocab, (16,), generator=gen).tolist()]
    run_engine(engine, warm, 4)
    run_transformers(hf, warm, 4)

    print(
        f"model {model_dir}  input {args.input_len}  output {args.output_len}  "
        f"threads {torch.get_num_threads()}  weights {engine.runner.model.quantization}"
    )
    header = f"{'C':>4} {'pdserve tok/s':>14} {'transformers tok/s':>19} {'ratio':>7} {'match':>7}"
    print(header)
    print("-" * len(header))
    for c in args.concurrency:
        prompts = [
            torch.randint(0, vocab, (args.input_len,), generator=gen).tolist() for _ in range(c)
        ]
        t_ours, ours = run_engine(engine, prompts, args.output_len)
        t_hf, theirs = run_transformers(hf, prompts, args.output_len)
        n = c * args.output_len
        same = sum(a == b for a, b in zip(ours, theirs, strict=True))
        print(
            f"{c:>4} {n / t_ours:>14.1f} {n / t_hf:>19.1f} {t_hf / t_ours:>6.2f}x {same:>3}/{c:<3}"
        )
    if engine.block_manager.num_used_blocks:
        raise SystemExit("blocks leaked")


if __name__ == "__main__":
    main()
