"""Greedy tokens and last-position logits of the engine equal transformers' (float32)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_manager import block_hashes
from pdserve.engine.scheduler import Sequence
from tests.conftest import ARCHS
from tests.engine_util import (
    greedy,
    hf_greedy,
    hf_last_logits,
    make_engine,
    prompts,
    run_all,
)

MAX_TOKENS = 12


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(model_dirs, arch: str) -> None:
    path = model_dirs[arch]
    # a 32-token budget chunks the longer prompts over several steps
    engine = make_engine(path, max_num_batched_tokens=32)
    batch = prompts(engine.model_config.vocab_size)
    outs = engine.generate(batch, greedy(MAX_TOKENS))
    for prompt, out in zip(batch, outs, strict=True):
        assert out.new_token_ids == hf_greedy(path, prompt, MAX_TOKENS), len(prompt)
        assert out.finish_reason == "length"
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_last_position_logits_match(model_dirs, arch: str) -> None:
    path = model_dirs[arch]
    engine = make_engine(path)
    batch = prompts(engine.model_config.vocab_size, [5, 17, 40], seed=1)
    seqs = [Sequence(f"r{i}", p, greedy(1)) for i, p in enumerate(batch)]
    for s in seqs:
        engine.scheduler.add(s)
    scheduled = engine.scheduler.schedule()
    logits = engine.runner.execute(engine.runner.prepare(scheduled.seqs, scheduled.num_new_tokens))
    for row, prompt in enumerate(batch):
        ref = hf_last_logits(path, prompt)
        torch.testing.assert_close(logits[row], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_requests_joining_midway(model_dirs, arch: str) -> None:
    path = model_dirs[arch]
    engine = make_engine(path, max_num_batched_tokens=24)
    first = prompts(engine.model_config.vocab_size, [9, 30, 4, 18], seed=2)
    later = prompts(engine.model_config.vocab_size, [21, 2, 45, 11], seed=3)
    for i, p in enumerate(first):
        engine.add_request(f"a{i}", p, greedy(MAX_TOKENS))
    steps = [engine.step() for _ in range(3)]
    assert any(o.new_token_ids for step in steps for o in step)
    for i, p in enumerate(later):
        engine.add_request(f"b{i}", p, greedy(MAX_TOKENS))
    done = run_all(engine)
    for step in steps:
        for o in step:
            done[o.request_id].new_token_ids[:0] = o.new_token_ids
    for prefix, group in (("a", first), ("b", later)):
        for i, p in enumerate(group):
            assert done[f"{prefix}{i}"].new_token_ids == hf_greedy(path, p, MAX_TOKENS)
    assert engine.block_manager.num_used_blocks == 0


def test_preemption_by_recompute_keeps_tokens(model_dirs) -> None:
    path = model_dirs["llama"]
    # 14 blocks of 4 tokens cannot hold four 10-token prompts growing by 16 tokens each
    engine = make_engine(path, num_blocks=14)
    batch = prompts(engine.model_config.vocab_size, [10, 10, 10, 10], seed=4)
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, greedy(16))
    seqs = list(engine.requests.values())
    done = run_all(engine)
    assert sum(s.num_preemptions for s in seqs) > 0
    for i, p in enumerate(batch):
        assert done[f"r{i}"].new_token_ids == hf_greedy(path, p, 16)
    assert engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hit_gives_same_tokens(model_dirs) -> None:
    path = model_dirs["qwen2"]
    engine = make_engine(path)
    vocab = engine.model_config.vocab_size
    shared = prompts(vocab, [21], seed=5)[0]
    a, b = [*shared, 1, 2, 3], [*shared, 7, 8]
    first = engine.generate([a], greedy(MAX_TOKENS))[0]
    assert first.num_cached_tokens == 0
    bm = engine.block_manager
    shared_blocks = [bm.cached[h] for h in block_hashes(a, 4, [])[:5]]
    engine.add_request("b", b, greedy(MAX_TOKENS))
    seq = engine.requests["b"]
    first_step = engine.step()
    assert seq.block_table[:5] == shared_blocks
    done = run_all(engine)
    done["b"].new_token_ids[:0] = first_step[0].new_token_ids
    # 21 shared tokens = 5 full blocks of 4, reused by id
    assert done["b"].num_cached_tokens == 20
    assert seq.num_cached_tokens == 20
    assert first.new_token_ids == hf_greedy(path, a, MAX_TOKENS)
    assert done["b"].new_token_ids == hf_greedy(path, b, MAX_TOKENS)
    assert bm.num_used_blocks == 0
