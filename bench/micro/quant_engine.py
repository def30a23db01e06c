"""Decode and prefill speed of the engine's weight forms, side by side in one process.

Every form (float32, int8, int4, the GGUF's own blocks kept) is loaded once; each round runs
each form in turn (the order rotates each round) at each concurrency C: C random prompts of
``--input-len`` tokens, greedy. A form's decode time per step is the time of a generate with
``1 + --output-len`` new tokens minus that of one with 1 (the prefill), over ``--output-len``
steps; prefill time is the second alone. Prints medians over rounds and each form's ratio to
float32 (decode tokens/s = C / step time).

    .venv/bin/python bench/micro/quant_engine.py                  # SmolLM2, C = 1 8 32, 1 thread
    .venv/bin/python bench/micro/quant_engine.py --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.models.store import DEFAULT_MODEL, resolve_model
from pdserve.protocol.sampling import SamplingParams

# form -> (--quantization, --quant-activations); "+a8": int8 activations (engine/quant/qdot.py)
FORMS = {
    "float32": ("none", "float32"),
    "int8": ("int8", "float32"),
    "int4": ("int4", "float32"),
    "gguf": ("auto", "float32"),
    "int8+a8": ("int8", "int8"),
    "int4+a8": ("int4", "int8"),
    "gguf+a8": ("auto", "int8"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def timed(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    engines = {}
    for form in args.forms:
        start = time.perf_counter()
        engines[form] = LLMEngine(
            EngineConfig(
                model=model,
                quantization=FORMS[form][0],
                quant_activations=FORMS[form][1],
                threads=args.threads,
                cache=CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False),
                scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
            )
        )
        print(
            f"{form}: {engines[form].runner.model.quantization}, "
            f"loaded in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    g = torch.Generator().manual_seed(0)
    step: dict[tuple[str, int], list[float]] = {}
    prefill: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        order = args.forms[r % len(args.forms) :] + args.forms[: r % len(args.forms)]
        for c in args.concurrency:
            vocab = engines[args.forms[0]].model_config.vocab_size
            prompts = torch.randint(100, vocab - 1, (c, args.input_len), generator=g).tolist()
            for form in order:
                first = timed(engines[form], prompts, 1)
                whole = timed(engines[form], prompts, 1 + args.output_len)
                step.setdefault((form, c), []).append((whole - first) / args.output_len)
                prefill.setdefault((form, c), []).append(first)
        print(f"round {r + 1} done", flush=True)
    print(
        f"\nthreads {args.threads}, input {args.input_len}, output {args.output_len}, "
        f"{args.rounds} rounds, medians"
    )
    print("| C | form | decode tok/s | x float32 | step ms | prefill s | x float32 |")
    print("|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        base_s = statistics.median(step[("float32", c)]) if "float32" in args.forms else None
        base_p = statistics.median(prefill[("float32", c)]) if "float32" in args.forms else None
        for form in args.forms:
            s, p = statistics.median(step[(form, c)]), statistics.median(prefill[(form, c)])
            ds = f"{base_s / s:.2f}" if base_s else "-"
            dp = f"{base_p / p:.2f}" if base_p else "-"
            print(f"| {c} | {form} | {c / s:.1f} | {ds} | {s * 1e3:.1f} | {p:.2f} | {dp} |")


if __name__ == "__main__":
    main()
