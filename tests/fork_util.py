"""Helpers for the fork tests (engine/fork.py): n choices of one prompt, blocks of 4."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.protocol.sampling import SamplingParams
from tests.engine_util import make_engine, prompts, run_all

N = 3
IDS = ["a", "b", "c"]


def seeded(choice: int, max_tokens: int = 8, **kw: object) -> SamplingParams:
    """Choice ``c`` of a seeded request draws from seed + c, as worker/wire.py builds it."""
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=40 + choice, ignore_eos=True, **kw
    )


def prompt_of(engine: LLMEngine, length: int) -> list[int]:
    return prompts(engine.model_config.vocab_size, [length], seed=length)[0]


def separate(tiny_dir, prompt: list[int], params: list[SamplingParams]) -> list[RequestOutput]:
    """What n requests of their own give today (n engine requests of one prompt)."""
    return make_engine(tiny_dir).generate([prompt] * len(params), params)


def assert_same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        assert [lp.token_id for lp in g.new_logprobs] == [lp.token_id for lp in w.new_logprobs]
        assert [lp.logprob for lp in g.new_logprobs] == pytest.approx(
            [lp.logprob for lp in w.new_logprobs], abs=1e-4
        )


def refs(engine: LLMEngine, ids: range) -> list[int]:
    return [engine.block_manager.ref_counts[i] for i in ids]


def tables(engine: LLMEngine, ids: list[str]) -> list[list[int]]:
    return [engine.requests[i].block_table for i in ids]


def same_kv(engine: LLMEngine, a: int, b: int, rows: int) -> bool:
    return all(
        torch.equal(layer[a, :, :rows], layer[b, :, :rows])
        for layer in engine.runner.kv_cache.layers
    )


def prefill_n(prefill: LLMEngine, prompt: list[int], params: list[SamplingParams]):
    """The prefill worker's part: the prompt once, token 0 of each choice, KV held under "r"."""
    first = [dataclasses.replace(p, max_tokens=1, min_tokens=min(p.min_tokens, 1)) for p in params]
    prefill.forks.add_request_n("r", IDS, prompt, first, hold_kv=True)
    outs = run_all(prefill)
    assert sorted(outs) == IDS  # the prompt's own id never reports
    return [outs[i] for i in IDS]


def hand_off(prefill: LLMEngine, decode: LLMEngine, token0: list[RequestOutput], prompt, params):
    """Push the held KV into the decode engine's one reservation and fork it there."""
    dst = decode.handoff.reserve("r", len(prompt) + 1, choices=N)
    src = prefill.handoff.held_block_ids("r")
    for s_layer, d_layer in zip(
        prefill.runner.kv_cache.layers, decode.runner.kv_cache.layers, strict=True
    ):
        d_layer[dst[: len(src)]] = s_layer[src]
    prefill.handoff.release("r")
    decode.handoff.add_prefilled_n(
        "r",
        IDS,
        prompt,
        [o.new_token_ids[0] for o in token0],
        params,
        [o.new_logprobs[0] if o.new_logprobs else None for o in token0],
    )
    return dst


def joined(token0: list[RequestOutput], rest: dict[str, RequestOutput]) -> list[RequestOutput]:
    return [
        RequestOutput(
            i, t.new_token_ids + rest[i].new_token_ids, t.new_logprobs + rest[i].new_logprobs
        )
        for i, t in zip(IDS, token0, strict=True)
    ]
