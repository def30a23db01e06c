"""Where a CPU decode step's time goes, by op kind, with the native rope (engine/cpu_rope.py)
and without (``CausalLM.use_native_rope(False)``: torch's ops).

The model is loaded as ``make serve`` serves it (the default model, its GGUF's quantized
layers kept). For each batch size B: B random prompts are prefilled and one decode step of
them prepared; each round runs that step's model (``ModelRunner.execute``: the forward and the
logits; no scheduling or sampling) ``--steps`` times with each path in turn (the order flips
every round), and ``--profile-steps`` more under torch.profiler. The C kernels (quantized
linear, attention, norm, rope) are ctypes calls the profiler cannot see: each is wrapped
in a ``record_function`` while profiling, so its time shows as that label's self time; "python,
other" is what the step's wall time leaves over (profiling slows the small ops most).
Prints, per B, a table of ms per step by kind (medians over rounds) and the plain step time.

    .venv/bin/python bench/micro/decode_ops.py                   # B = 1 8, 1 thread, 5 rounds
    .venv/bin/python bench/micro/decode_ops.py --batch 1 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pdserve.engine import cpu_norm, model, rope
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import StepInputs
from pdserve.engine.quant.linear import QuantLinear
from pdserve.models.store import DEFAULT_MODEL, resolve_model
from pdserve.protocol.sampling import SamplingParams

PATHS = {"torch rope": False, "native rope": True}  # use_native_rope(...)
STEP = "decode step"
OTHER = "python, other"
Profile = dict[str, float]  # op kind -> ms per step


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="timed steps a round and path")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=16, help="rows of the table")
    return p.parse_args()


def _labelled(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def labels(engine: LLMEngine) -> Iterator[None]:
    """The C-kernel calls wrapped in ``record_function`` labels, for a profile only."""
    backend = type(engine.runner.backend)
    patches = [
        (QuantLinear, "forward", "C qlinear (+ its python)"),
        (backend, "forward", "attention backend (C kernel, python)"),
        (model, "add_rms_norm", "C add + rms_norm"),
        (rope, "rotate_in_place", "C rope"),
    ]
    patches = [p for p in patches if hasattr(p[0], p[1])]  # a tree from before cpu_rope.py
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, label in patches:
            setattr(owner, name, _labelled(label, getattr(owner, name)))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def decode_inputs(engine: LLMEngine, batch: int, input_len: int, seed: int) -> StepInputs:
    """A decode step of ``batch`` sequences, prefilled first, ready to run again and again (it
    writes the same KV slots each time)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)  # none ends
    for i, prompt in enumerate(torch.randint(100, vocab - 1, (batch, input_len), generator=g)):
        engine.add_request(f"b{batch}-{i}", prompt.tolist(), params)
    while any(not s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    scheduled = engine.scheduler.schedule()
    assert len(scheduled.seqs) == batch and all(n == 1 for n in scheduled.num_new_tokens)
    return engine.runner.prepare(scheduled.seqs, scheduled.num_new_tokens)


def timed_steps(engine: LLMEngine, inputs: StepInputs, steps: int) -> float:
    """Median seconds of one decode step's model run."""
    times = []
    for _ in range(steps):
        begun = time.perf_counter()
        engine.runner.execute(inputs)
        times.append(time.perf_counter() - begun)
    return statistics.median(times)


def profiled_steps(engine: LLMEngine, inputs: StepInputs, steps: int) -> Profile:
    """Self time per op kind (aten op or label), ms per step, and the step's own wall time."""
    with labels(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP):
                engine.runner.execute(inputs)
    rows = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
    step = next(e for e in prof.key_averages() if e.key == STEP).cpu_time_total / 1e3 / steps
    rows.pop(STEP)
    rows[OTHER] = rows.get(OTHER, 0.0) + max(0.0, step - sum(rows.values()))
    rows[STEP] = step
    return rows


def report(
    batch: int, plain: dict[str, list[float]], prof: dict[str, list[Profile]], top: int
) -> None:
    paths = list(plain)
    med = {
        path: {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
        for path, runs in prof.items()
    }
    kinds = sorted(
        {k for m in med.values() for k in m if k != STEP},
        key=lambda k: -max(m.get(k, 0.0) for m in med.values()),
    )
    shown, rest = kinds[:top], kinds[top:]
    print(f"\nbatch {batch}: ms per decode step, medians of {len(plain[paths[0]])} rounds")
    print("| op kind | " + " | ".join(paths) + " |")
    print("|---|" + "---|" * len(paths))
    for k in shown:
        print(f"| {k} | " + " | ".join(f"{med[p].get(k, 0.0):.3f}" for p in paths) + " |")
    if rest:
        cells = " | ".join(f"{sum(med[p].get(k, 0.0) for k in rest):.3f}" for p in paths)
        print(f"| {len(rest)} other kinds | {cells} |")
    cells = " | ".join(f"{med[p][STEP]:.3f}" for p in paths)
    print(f"| **step, profiled** | {cells} |")
    cells = " | ".join(f"{statistics.median(plain[p]) * 1e3:.3f}" for p in paths)
    print(f"| **step, not profiled** | {cells} |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(
            model=resolve_model(args.model),
            quantization="auto",
            threads=args.threads,
            cache=CacheConfig(kv_cache_memory=1 << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        )
    )
    lm = engine.runner.model
    print(f"{args.model}: {lm.quantization}, backend {engine.runner.backend.name}", flush=True)
    try:
        from pdserve.engine.cpu_rope import kernel

        print(f"C rope: {kernel()}; C norm: {cpu_norm._kernel() is not None}")
    except ImportError:  # a tree from before engine/cpu_rope.py
        print(f"C norm: {cpu_norm._kernel() is not None}")
    # a tree from before engine/cpu_rope.py (no switch): one column, as it was
    paths = PATHS if hasattr(lm, "use_native_rope") else {"before": True}
    use_native_rope = getattr(lm, "use_native_rope", lambda on: None)
    for b in args.batch:
        inputs = decode_inputs(engine, b, args.input_len, seed=b)
        plain: dict[str, list[float]] = {p: [] for p in paths}
        prof: dict[str, list[Profile]] = {p: [] for p in paths}
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for path in order:
                use_native_rope(paths[path])
                plain[path].append(timed_steps(engine, inputs, args.steps))
                prof[path].append(profiled_steps(engine, inputs, args.profile_steps))
            print(f"batch {b}, round {r + 1} done", flush=True)
        use_native_rope(True)
        for rid in list(engine.requests.live):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        report(b, plain, prof, args.top)


if __name__ == "__main__":
    main()
