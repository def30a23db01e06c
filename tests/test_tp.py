"""Tensor parallelism (engine/tp/): the split's arithmetic, and groups of real processes whose
greedy tokens equal one process's.

The split sums o_proj's and down_proj's partial products over ranks (an all-reduce) where one
process sums them in one matmul: the logits move by float32 rounding. The bound this suite holds
the logprobs to (LOGPROB_BOUND) is ~100 times what it measured on these models; greedy tokens are
held exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.engine.config import ConfigError, ModelConfig
from pdserve.engine.tp.layout import TPLayout, allowed_sizes, check_tp_size
from tests.engine_util import greedy, make_engine, prompts

LOGPROB_BOUND = 1e-3


def _cfg(heads: int = 8, kv: int = 4, inter: int = 1024, vocab: int = 1000) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 64 * heads,
            "intermediate_size": inter,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
        }
    )


# ---- the split -------------------------------------------------------------------------------
def test_heads_split_evenly_and_query_heads_read_their_own_kv_heads() -> None:
    cfg = _cfg(heads=8, kv=4)
    ranks = [TPLayout(cfg, r, 2) for r in range(2)]
    assert [(t.heads, t.kv_heads) for t in ranks] == [
        (range(0, 4), range(0, 2)),
        (range(4, 8), range(2, 4)),
    ]
    group = cfg.num_heads // cfg.num_kv_heads
    for t in ranks:
        assert {h // group for h in t.heads} == set(t.kv_heads)


def test_fewer_kv_heads_than_ranks_are_replicated() -> None:
    cfg = _cfg(heads=8, kv=2)
    ranks = [TPLayout(cfg, r, 4) for r in range(4)]
    assert [t.kv_heads for t in ranks] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [ranks[0].kv_owner(h) for h in range(2)] == [0, 2]
    for t in ranks:
        assert {h // 4 for h in t.heads} == set(t.kv_heads)
    assert ranks[3].local_config().num_kv_heads == 1


def test_checkpoint_slices_follow_megatron() -> None:
    t = TPLayout(_cfg(heads=8, kv=4, inter=1024, vocab=1001), 1, 2)
    d = 64
    assert t.slice_of("model.layers.0.self_attn.q_proj.weight") == (0, 4 * d, 8 * d)
    assert t.slice_of("model.layers.0.self_attn.k_proj.bias") == (0, 2 * d, 4 * d)
    assert t.slice_of("model.layers.0.self_attn.o_proj.weight") == (1, 4 * d, 8 * d)
    assert t.slice_of("model.layers.0.self_attn.o_proj.bias") is None  # added once, by rank 0
    assert t.slice_of("model.layers.0.mlp.up_proj.weight") == (0, 512, 1024)
    assert t.slice_of("model.layers.0.mlp.down_proj.weight") == (1, 512, 1024)
    assert t.slice_of("lm_head.weight") == (0, 501, 1001)  # the last rank takes the remainder
    assert t.slice_of("model.embed_tokens.weight") is None
    assert t.slice_of("model.layers.0.input_layernorm.weight") is None


def test_sizes_a_model_does_not_allow_are_refused_with_the_reason() -> None:
    cfg = _cfg(heads=9, kv=3, inter=1536)  # SmolLM2-135M's heads
    assert allowed_sizes(cfg, limit=9) == [1, 3]  # 1536 rows do not divide by 9
    with pytest.raises(ConfigError, match=r"9 query heads do not divide by 2.*allows: 1, 3\)"):
        check_tp_size(cfg, 2)
    with pytest.raises(ConfigError, match="rows do not divide"):
        check_tp_size(dataclasses.replace(cfg, intermediate_size=1537), 3)


# ---- groups of processes -----------------------------------------------------------------------
def _run(path: Path, tp: int, lengths: list[int], max_tokens: int = 12, **engine: object):
    eng = make_engine(path, tensor_parallel_size=tp, threads=1, **engine)
    cfg = eng.model_config
    outs = eng.generate(prompts(cfg.vocab_size, lengths, seed=3), greedy(max_tokens, logprobs=0))
    eng.close()
    return [o.new_token_ids for o in outs], [[lp.logprob for lp in o.new_logprobs] for o in outs]


def _close(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def test_group_tokens_equal_one_process(small_dir: Path) -> None:
    """small at TP 2: 8 query / 4 KV heads, an untied head split by vocabulary; chunked
    prompts (TP 4, below, takes the tied head and replicated KV heads)."""
    lengths = [1, 5, 17, 40]
    ref_tokens, ref_lps = _run(small_dir, 1, lengths, max_num_batched_tokens=32)
    tokens, lps = _run(small_dir, 2, lengths, max_num_batched_tokens=32)
    assert tokens == ref_tokens
    assert _close(lps, ref_lps) < LOGPROB_BOUND


def test_replicated_kv_heads_and_a_tied_head(tiny_dir: Path) -> None:
    """tiny: 4 query / 2 KV heads at TP 4 (each KV head on two ranks), a tied output head.
    A held prompt's KV gathered on rank 0's staging blocks is then the whole-head KV one
    process computes, each replicated head taken once."""
    import torch

    lengths, held = [3, 9, 30], prompts(512, [30], seed=9)[0]  # 8 blocks of 4
    runs = []
    for tp in (1, 4):
        eng = make_engine(tiny_dir, tensor_parallel_size=tp, threads=1)
        cfg = eng.model_config
        outs = eng.generate(prompts(cfg.vocab_size, lengths, seed=3), greedy(12, logprobs=0))
        eng.add_request("held", held, greedy(1), hold_kv=True)
        while eng.has_unfinished():
            eng.step()
        ids = eng.handoff.outgoing("held", eng.handoff.held_block_ids("held"))
        kv = torch.stack([layer[ids] for layer in eng.status.kv_layers]).clone()
        eng.handoff.release("held")
        staging = eng.runner.staging
        assert staging is None or staging.num_free == staging.num_blocks  # given back
        eng.close()
        tokens = [o.new_token_ids for o in outs]
        runs.append((tokens, [[lp.logprob for lp in o.new_logprobs] for o in outs], kv))
    (ref_tokens, ref_lps, ref_kv), (tokens, lps, kv) = runs
    assert tokens == ref_tokens
    assert _close(lps, ref_lps) < LOGPROB_BOUND
    assert kv.shape == ref_kv.shape  # [layers, 8 blocks, 2, 4, 2 KV heads, 16]
    assert torch.allclose(kv, ref_kv, atol=1e-5)


def test_request_features_in_a_group_equal_one_process(tiny_dir: Path) -> None:
    """At TP 2 as in one process: a regex-constrained output (rank 0's matcher), a seeded
    sampled one with penalties, a prompt served again from the prefix cache, and a cache too
    small for all of them at once (preemption and recompute on every rank)."""
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.protocol.sampling import SamplingParams, StructuredSpec

    tok = Tokenizer.from_dir(tiny_dir)
    spec = StructuredSpec("regex", r"[a-z]{3,6}-[0-9]{2}")
    prompt = tok.encode("a prompt of a few words, long enough to fill some blocks")
    batch = [prompt, prompt, prompt[:9], prompt + prompt]
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured=spec),
        SamplingParams(max_tokens=24, temperature=0.9, seed=11, frequency_penalty=0.5),
        greedy(24),
        greedy(24),
    ]
    runs = []
    for tp in (1, 2):
        eng = make_engine(tiny_dir, tensor_parallel_size=tp, threads=1, num_blocks=24)
        first = eng.generate(batch[:1], params[:1])  # its blocks stay in the prefix cache
        outs = first + eng.generate(batch[1:], params[1:])
        runs.append(([o.new_token_ids for o in outs], eng.scheduler.preemptions))
        assert eng.scheduler.prefix_hit_tokens > 0
        eng.close()
    (one, preempted_one), (two, preempted_two) = runs
    assert two == one
    assert preempted_two == preempted_one > 0
    assert tok.decode(one[0]).count("-") == 1  # the constrained one matched
