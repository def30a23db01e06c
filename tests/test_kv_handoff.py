"""Prefill on one engine, decode on another: the same tokens as one engine, every block freed.

KV moves here by a plain tensor copy between the two caches; kvtransfer's tests cover the
transports.
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.block_manager import NoFreeBlocks
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.messages import FinishReason
from pdserve.protocol.sampling import SamplingParams
from tests.engine_util import greedy, hf_greedy, make_engine, prompts, run_all


def disaggregated(
    prefill: LLMEngine, decode: LLMEngine, batch: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    for i, p in enumerate(batch):
        decode.handoff.reserve(f"r{i}", len(p) + 1)
        prefill.add_request(f"r{i}", p, first, hold_kv=True)
    token0 = {rid: out.new_token_ids for rid, out in run_all(prefill).items()}
    for i, p in enumerate(batch):
        rid = f"r{i}"
        src, dst = (
            prefill.handoff.held_block_ids(rid),
            decode.scheduler.waiting_for_kvs[rid].block_table,
        )
        for s_layer, d_layer in zip(
            prefill.runner.kv_cache.layers, decode.runner.kv_cache.layers, strict=True
        ):
            d_layer[dst[: len(src)]] = s_layer[src]
        prefill.handoff.release(rid)
        decode.handoff.add_prefilled(rid, p, token0[rid][0], params)
    rest = run_all(decode)
    return [token0[f"r{i}"] + rest[f"r{i}"].new_token_ids for i in range(len(batch))]


def test_greedy_disaggregated_equals_colocated_and_transformers(tiny_dir) -> None:
    prefill = make_engine(tiny_dir, max_num_batched_tokens=32)
    decode = make_engine(tiny_dir)
    batch = prompts(prefill.model_config.vocab_size)
    got = disaggregated(prefill, decode, batch, greedy(10))
    for p, tokens in zip(batch, got, strict=True):
        assert tokens == hf_greedy(tiny_dir, p, 10)
    assert prefill.block_manager.num_used_blocks == 0
    assert decode.block_manager.num_used_blocks == 0
    assert prefill.block_manager.num_cached_blocks > 0  # prompts stay in the prefix cache


def test_seeded_sampling_disaggregated_equals_colocated(tiny_dir) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=77, ignore_eos=True)
    colocated = make_engine(tiny_dir)
    batch = prompts(colocated.model_config.vocab_size, [6, 19], seed=13)
    expected = [o.new_token_ids for o in colocated.generate(batch, params)]
    got = disaggregated(make_engine(tiny_dir), make_engine(tiny_dir), batch, params)
    assert got == expected


def test_first_token_that_finishes_is_reported_and_freed(tiny_dir) -> None:
    decode = make_engine(tiny_dir)
    decode.handoff.reserve("r", 5)
    decode.handoff.add_prefilled("r", [1, 2, 3, 4], 9, greedy(1))
    [out] = decode.step()
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert out.finish_reason is FinishReason.LENGTH
    assert decode.block_manager.num_used_blocks == 0


def test_abort_frees_held_and_reserved_blocks(tiny_dir) -> None:
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    prefill.add_request("a", [5] * 9, greedy(1), hold_kv=True)
    run_all(prefill)
    assert prefill.block_manager.num_used_blocks == 3
    assert prefill.abort("a")
    assert prefill.block_manager.num_used_blocks == 0
    decode.handoff.reserve("b", 9)
    assert decode.block_manager.num_used_blocks == 3
    with pytest.raises(ValueError, match="already has blocks"):
        decode.handoff.reserve("b", 9)
    assert decode.abort("b")
    assert decode.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="no reserved blocks"):
        decode.handoff.add_prefilled("b", [1], 2, greedy(2))


def test_reservation_fails_cleanly_when_full(tiny_dir) -> None:
    decode = make_engine(tiny_dir, num_blocks=4)
    decode.handoff.reserve("a", 12)
    with pytest.raises(NoFreeBlocks):
        decode.handoff.reserve("b", 8)
    assert decode.block_manager.num_used_blocks == 3
    decode.abort("a")
    assert decode.block_manager.num_used_blocks == 0


def test_continuation_recomputes_and_continues(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    prompt = prompts(engine.model_config.vocab_size, [13], seed=20)[0]
    ref = hf_greedy(tiny_dir, prompt, 9)
    engine.handoff.reserve("r", 14)  # a reservation the failed transfer leaves behind is given back
    engine.handoff.add_continuation("r", prompt, ref[:4], greedy(9))
    out = run_all(engine)["r"]
    assert out.new_token_ids == ref[4:]
    assert engine.block_manager.num_used_blocks == 0


def test_seeded_continuation_equals_one_engine(tiny_dir) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    engine = make_engine(tiny_dir)
    prompt = prompts(engine.model_config.vocab_size, [7], seed=21)[0]
    full = engine.generate([prompt], params)[0].new_token_ids
    other = make_engine(tiny_dir)
    other.handoff.add_continuation("r", prompt, full[:3], params)
    assert full[:3] + run_all(other)["r"].new_token_ids == full
