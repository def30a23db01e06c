"""What each weight quantization costs in quality, on the real model, against its float32 form.

Modes (``--quantization`` / ``quant_group_size`` of the engine): float32 (none), int8,
int4-g32, int4-g64, int4-g192 (a group must divide the rows' width, 576 and 1,536 here: 128
does not), gguf (auto on the pulled directory: the GGUF's Q4_1/Q8_0 blocks kept).
Every figure is measured against float32:

- greedy agreement: 24 fixed prompts (``PROMPTS``), 64 new tokens each, through
  ``LLMEngine.generate`` (greedy, ``ignore_eos``, one batch). "prefix" = tokens equal to
  float32's up to each continuation's first divergence, over all tokens; "positional" = tokens
  equal at the same position over all tokens (after a divergence the two continuations differ,
  so this also counts coincidences); "identical" = continuations equal throughout.
- mean |Δ logprob|: teacher-forced on float32's greedy continuation (prompt + 64 tokens), so
  both models score the same tokens: mean over the 24 x 64 continuation tokens of
  |log p_mode(token) - log p_float32(token)|.
- perplexity of ``models/data/perplexity.txt`` (an original essay shipped in the package for
  this; models/data/README.md): teacher-forced over non-overlapping windows of ``--window``
  tokens (the first token of each window is context only), exp of the mean negative
  log-likelihood of every scored token.

Teacher forcing runs the engine's own step (``ModelRunner.execute``: the same model, linear
kernels and attention backend as serving) over one sequence whose blocks are taken from, and
given back to, the engine's block manager, with every row's logits asked for.

The pulled float32 weights are themselves the Q4_1 GGUF dequantized (SmolLM2 is published
here as that GGUF), so gguf vs float32 should be near-identical: it measures the quantized
kernels' arithmetic, not a loss of information. int8 and int4 re-quantize those already
Q4_1-rounded weights.

    .venv/bin/python bench/experiments/quant_quality.py                 # all modes, real model
    .venv/bin/python bench/experiments/quant_quality.py --modes float32 int8 --window 512

Prints a markdown table; writes ``bench/results/quant_quality.json``. The figures are
deterministic for a given machine and thread count (no timing is measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any  # the summary is JSON: values of every type, read by key

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import StepInputs, weight_bytes
from pdserve.protocol.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parents[1] / "results"
TEXT = Path(__file__).resolve().parents[2] / "models" / "data" / "perplexity.txt"

# name -> (EngineConfig.quantization, quant_group_size, quant_activations); "+a8" / "+a16":
# the quantized layers on int8 / int16 activations (engine/quant/qdot.py), the others on float32
MODES: dict[str, tuple[str, int, str]] = {
    "float32": ("none", 32, "float32"),
    "int8": ("int8", 32, "float32"),
    "int4-g32": ("int4", 32, "float32"),
    "int4-g64": ("int4", 64, "float32"),
    "int4-g192": ("int4", 192, "float32"),  # 128 does not divide SmolLM2's 576-wide rows
    "gguf": ("auto", 32, "float32"),
    "int8+a8": ("int8", 32, "int8"),
    "int4-g32+a8": ("int4", 32, "int8"),
    "gguf+a8": ("auto", 32, "int8"),
    "int8+a16": ("int8", 32, "int16"),
    "int4-g32+a16": ("int4", 32, "int16"),
    "gguf+a16": ("auto", 32, "int16"),
}

PROMPTS = [
    "The history of the printing press begins",
    "To make a good cup of tea, you should",
    "Photosynthesis is the process by which",
    "The three largest cities in Europe are",
    "Once upon a time, in a small village by the sea,",
    "A binary search tree is a data structure that",
    "The main causes of the First World War were",
    "Here is a simple recipe for bread:",
    "The difference between weather and climate is",
    "In Python, a list comprehension lets you",
    "The planets of the solar system, in order from the sun, are",
    "Dear hiring manager, I am writing to apply for",
    "The human heart has four chambers:",
    "Water boils at a lower temperature at high altitude because",
    "The best way to learn a new language is",
    "An electric motor works by",
    "The French Revolution began in 1789 when",
    "def fibonacci(n):",
    "The rules of chess say that a bishop",
    "Volcanoes form where",
    "A healthy breakfast might include",
    "The internet was originally designed to",
    "Shakespeare's plays are usually divided into",
    "To change a flat tyre on a car, first",
]


@dataclass
class ModeResult:
    quantization: str  # the model's own label (CausalLM.quantization)
    weight_bytes: int  # what the served weights hold (model_runner.weight_bytes)
    greedy: list[list[int]]  # per prompt, the 64 new tokens
    continuation_logprobs: list[float]  # teacher-forced on float32's continuations
    nll_sum: float
    nll_tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.nll_tokens)


def make_engine(
    model: str, quantization: str, group: int, activations: str, threads: int | None
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            threads=threads,
            quantization=quantization,
            quant_group_size=group,
            quant_activations=activations,
            cache=CacheConfig(block_size=16, num_blocks=1024, enable_prefix_caching=False),
            # no start-up timing: the step budget, and so how prompts are chunked, is fixed
            scheduler=SchedulerConfig(max_step_time_s=0),
        )
    )


@torch.inference_mode()
def step_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """Every position's logits ([len, V] float32; row i predicts token i + 1): one engine step
    over the whole sequence, prefilled into blocks the block manager lends for it."""
    runner, blocks = engine.runner, engine.block_manager
    n, bs = len(tokens), runner.kv_cache.block_size
    table = blocks.allocate_blocks(blocks.blocks_needed(n))
    try:
        slots = [table[p // bs] * bs + p % bs for p in range(n)]
        rows = list(range(n))
        ids, pos, slot_mapping, index = runner.buffers.load(tokens, list(range(n)), slots, rows)
        meta = AttentionMetadata(slot_mapping, [n], [n], [table], bs)
        return runner.execute(StepInputs(ids, pos, meta, rows, [], index))
    finally:
        blocks.free_blocks(table)


def token_logprobs(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i = 1 .. len - 1 ([len - 1] float64)."""
    logp = torch.log_softmax(step_logits(engine, tokens)[:-1].double(), dim=-1)
    return logp.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)


def run_mode(
    engine: LLMEngine,
    prompts: list[list[int]],
    reference: list[list[int]] | None,
    text: list[int],
    window: int,
    new_tokens: int,
) -> ModeResult:
    """Greedy continuations, logprobs of ``reference`` (float32's continuations; this mode's
    own when None) and the text's negative log-likelihood."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    greedy = [out.new_token_ids for out in engine.generate(prompts, params)]
    scored: list[float] = []
    for prompt, cont in zip(prompts, reference or greedy, strict=True):
        lp = token_logprobs(engine, prompt + cont)
        scored += lp[len(prompt) - 1 :].tolist()  # the continuation's tokens
    nll, count = 0.0, 0
    for start in range(0, len(text) - 1, window):
        chunk = text[start : start + window]
        if len(chunk) > 1:
            lp = token_logprobs(engine, chunk)
            nll, count = nll - lp.sum().item(), count + lp.numel()
    if engine.block_manager.num_used_blocks:
        raise RuntimeError("the engine kept blocks after the measurement")
    model = engine.runner.model
    return ModeResult(model.quantization, weight_bytes(model), greedy, scored, nll, count)


def agreement(mode: list[list[int]], ref: list[list[int]]) -> dict[str, float]:
    total = sum(len(r) for r in ref)
    prefix = positional = identical = 0
    for a, b in zip(mode, ref, strict=True):
        same = [x == y for x, y in zip(a, b, strict=True)]
        prefix += next((i for i, s in enumerate(same) if not s), len(same))
        positional += sum(same)
        identical += all(same)
    return {
        "prefix": prefix / total,
        "positional": positional / total,
        "identical": identical,
    }


def summarise(results: dict[str, ModeResult]) -> dict[str, dict[str, Any]]:
    ref = results["float32"]
    out: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        diffs = [
            abs(a - b)
            for a, b in zip(r.continuation_logprobs, ref.continuation_logprobs, strict=True)
        ]
        out[name] = {
            "quantization": r.quantization,
            "weight_mib": r.weight_bytes / 2**20,
            "agreement": agreement(r.greedy, ref.greedy),
            "logprob_mad": sum(diffs) / len(diffs),
            "logprob_max_diff": max(diffs),
            "perplexity": r.perplexity,
            "perplexity_vs_float32": r.perplexity / ref.perplexity - 1,
            "scored_text_tokens": r.nll_tokens,
        }
    return out


def table(summary: dict[str, dict[str, Any]], prompts: int) -> str:
    lines = [
        "| mode | weights | MiB | greedy prefix | positional | identical | mean abs Δlogprob "
        "| perplexity | vs float32 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        a = s["agreement"]
        lines.append(
            f"| {name} | {s['quantization']} | {s['weight_mib']:.0f} | {a['prefix']:.1%} "
            f"| {a['positional']:.1%} "
            f"| {a['identical']}/{prompts} | {s['logprob_mad']:.4f} | {s['perplexity']:.3f} "
            f"| {s['perplexity_vs_float32']:+.2%} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="name or directory")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--window", type=int, default=1024, help="perplexity window, tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS / "quant_quality.json")
    return p.parse_args()


def main() -> None:
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.models.store import resolve_model

    args = parse_args()
    modes = ["float32", *[m for m in args.modes if m != "float32"]]
    model = resolve_model(args.model)
    tok = Tokenizer.from_dir(model)
    prompts = [tok.encode(p) for p in PROMPTS]
    text = tok.encode(TEXT.read_text(encoding="utf-8"))
    results: dict[str, ModeResult] = {}
    for name in modes:
        engine = make_engine(model, *MODES[name], args.threads)
        window = min(args.window, engine.max_model_len)
        reference = results["float32"].greedy if results else None
        results[name] = run_mode(engine, prompts, reference, text, window, args.new_tokens)
        print(
            f"{name}: {results[name].quantization}, perplexity {results[name].perplexity:.3f}",
            flush=True,
        )
        del engine
        gc.collect()
    summary = summarise(results)
    print(table(summary, len(prompts)))
    report = {
        "model": args.model,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "text": {"file": "models/data/perplexity.txt", "tokens": len(text), "window": window},
        "modes": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
