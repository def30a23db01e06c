"""gpu.py's tensor-parallel rows: a TP-2 group (NCCL, one GPU a rank; no CUDA graphs in a
group yet) against one process on the same model, bf16. Needs two GPUs: NCCL refuses two ranks
on one. NOT yet run on a GPU.

    tp2 greedy tokens vs TP 1     the built-in small model, prompts of 5..512 tokens
    tp2 decode step, batch 1      Llama 3.2 1B's shape (make-model llama-1b): step time at
                                  TP 2 against TP 1 (aim: 0.6x or less)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams

PROMPTS, TOKENS, STEPS = [5, 17, 64, 200, 512], 32, 32


def two_gpus_status() -> tuple[bool, str]:
    """Whether two GPUs are visible (a TP-2 group over NCCL needs one a rank)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return False, f"a TP-2 group needs two GPUs, {count} visible"
    return True, f"{count} GPUs"


def _engine(model: Path, tp: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="bfloat16",
            device="cuda",
            tensor_parallel_size=tp,
            cache=CacheConfig(block_size=16, num_blocks=2048),
            scheduler=SchedulerConfig(max_step_time_s=0, tpot_target_s=0),
        )
    )


def tp_rows() -> dict[str, str]:
    from pdserve.models.make_model import default_model_dir, make_model
    from pdserve.models.store import models_dir

    small = default_model_dir("small")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in PROMPTS]
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        engine = _engine(small, tp)
        outs[tp] = [o.new_token_ids for o in engine.generate(prompts, greedy)]
        engine.close()
    same = sum(a == b for a, b in zip(outs[1], outs[2], strict=True))
    rows = {"tp_greedy": f"{same}/{len(prompts)} prompts equal"}
    one_b = models_dir() / "llama-1b-shape-seed0"
    if not (one_b / "config.json").is_file():
        make_model(one_b, preset="llama-1b", dtype="bfloat16")
    step = {}
    for tp in (1, 2):
        engine = _engine(one_b, tp)
        engine.add_request("r", [1] * 16, SamplingParams(max_tokens=STEPS + 2, ignore_eos=True))
        engine.step()
        times = []
        while engine.has_unfinished():
            torch.cuda.synchronize()
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step[tp] = statistics.median(times)
        engine.close()
    rows["tp_decode_1"] = (
        f"TP 2 {step[2] * 1e3:.2f} ms, TP 1 {step[1] * 1e3:.2f} ms: {step[2] / step[1]:.2f}x"
    )
    return rows
