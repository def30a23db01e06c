"""What a JSON Schema constraint costs a decode step: C streams under the constraint against C
free streams, side by side in one run (several rounds, medians).

Each stream writes a long JSON array (the schema pins its item count; free streams decode as
many tokens as the greedy constrained output has, ignoring eos). Prints the median decode
step time of each, the mean number of streams a step, and the time inside the constraint's mask
(fill and unpack; the matcher's advance per token is a few µs) as a share of the step.

    .venv/bin/python bench/micro/structured.py                   # SmolLM2-135M, 32 streams
    .venv/bin/python bench/micro/structured.py --model tiny --concurrency 8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import pdserve.engine.sampler as sampler_module
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.scheduler import Sequence
from pdserve.engine.tokenizer import Tokenizer
from pdserve.models.store import DEFAULT_MODEL, resolve_model
from pdserve.protocol.messages import StructuredSpec
from pdserve.protocol.sampling import SamplingParams

ITEMS = 40  # array items: about 3 tokens each
SCHEMA = {
    "type": "object",
    "properties": {
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": ITEMS,
            "maxItems": ITEMS,
        }
    },
    "required": ["values"],
    "additionalProperties": False,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


class Timed:
    """Seconds spent in the engine's constraint calls (mask, advance)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._apply = sampler_module.apply_constraints

    def __enter__(self) -> Timed:
        def apply(logits: torch.Tensor, seqs: list[Sequence]) -> None:
            start = time.perf_counter()
            self._apply(logits, seqs)
            self.seconds += time.perf_counter() - start

        sampler_module.apply_constraints = apply
        return self

    def __exit__(self, *exc: object) -> None:
        sampler_module.apply_constraints = self._apply


def decode_steps(
    engine: LLMEngine, params: list[SamplingParams], prompts: list[list[int]], tag: str
) -> tuple[list[float], int]:
    """Prefill every prompt, then time each decode step that advances every stream (the
    tail, where streams have finished, is left out so both sides compare full batches)."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, p)
    steps: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        decoding = [o for o in outs if o.new_token_ids and o.num_output_tokens > 1]
        if len(decoding) == len(prompts):
            steps.append(elapsed)
            tokens += len(decoding)
    return steps, tokens


def main() -> None:
    args = parse_args()
    model_dir = resolve_model(args.model)
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            threads=args.threads,
            cache=CacheConfig(block_size=16, num_blocks=2048),
            scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096),
        )
    )
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": "Give me forty numbers as JSON."}])
    prompts = [prompt] * args.concurrency
    spec = StructuredSpec("json", json.dumps(SCHEMA))
    # the constrained outputs' length, so the free streams decode as many tokens
    probe = engine.generate(
        [prompt], SamplingParams(max_tokens=600, temperature=0.0, structured=spec)
    )[0]
    length = probe.num_output_tokens
    print(f"model {Path(model_dir).name}, {args.concurrency} streams, {length} output tokens each")
    # side -> each round's (median step s, streams a step)
    rows: dict[str, list[tuple[float, float]]] = {"free": [], "constrained": []}
    shares = []
    for r in range(args.rounds):
        free = [
            SamplingParams(max_tokens=length, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(len(prompts))
        ]
        steps, tokens = decode_steps(engine, free, prompts, f"free{r}")
        rows["free"].append((statistics.median(steps), tokens / len(steps)))
        constrained = [
            SamplingParams(max_tokens=length + 40, temperature=1.0, seed=i, structured=spec)
            for i in range(len(prompts))
        ]
        with Timed() as timed:
            steps, tokens = decode_steps(engine, constrained, prompts, f"json{r}")
        rows["constrained"].append((statistics.median(steps), tokens / len(steps)))
        shares.append(timed.seconds / sum(steps))
    print(f"{'':12} {'median step ms':>15} {'streams a step':>15}")
    for name, values in rows.items():
        step = statistics.median(v[0] for v in values) * 1e3
        width = statistics.median(v[1] for v in values)
        print(f"{name:12} {step:15.2f} {width:15.1f}")
    ratio = statistics.median(
        c[0] / f[0] for c, f in zip(rows["constrained"], rows["free"], strict=True)
    )
    print(f"constrained / free step time: {ratio:.3f} (median of {args.rounds} rounds)")
    print(f"constraint mask share of the constrained step: {statistics.median(shares):.1%}")


if __name__ == "__main__":
    main()
