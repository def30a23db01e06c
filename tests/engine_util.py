"""Helpers for engine tests: engines over tiny checkpoints and transformers references."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.protocol.sampling import SamplingParams

PROMPT_LENGTHS = [1, 3, 7, 12, 16, 25, 33, 60]


def make_engine(
    path: Path,
    block_size: int = 4,
    num_blocks: int = 512,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    prefix_caching: bool = True,
    dtype: str = "float32",
    **engine: object,
) -> LLMEngine:
    """An engine on ``path``; ``engine`` passes other EngineConfig fields (cpu_linear, ...)."""
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype=dtype,
            **engine,  # type: ignore[arg-type]
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
            ),
        )
    )


def prompts(vocab_size: int, lengths: list[int] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw}, max_tokens=max_tokens)


@functools.cache
def hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: Path, prompt: list[int], max_tokens: int) -> list[int]:
    model = hf_model(path)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_tokens, "transformers stopped early"
    return tokens


@torch.inference_mode()
def hf_last_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([prompt])).logits[0, -1].float()


def run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until idle; accumulate each request's tokens."""
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            acc = done.setdefault(out.request_id, RequestOutput(out.request_id, []))
            acc.new_token_ids += out.new_token_ids
            acc.new_logprobs += out.new_logprobs
            acc.finished, acc.finish_reason = out.finished, out.finish_reason
            acc.stop_reason, acc.num_cached_tokens = out.stop_reason, out.num_cached_tokens
    return done
