"""Speculation across the split (in-process cluster, real transports): the decode worker
speculates; in draft mode the prefill worker computes the draft's prompt KV and it travels
with the target's, so the decode worker computes no draft prompt token. Tokens equal one
engine's without speculation."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.config import SpeculativeConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer.base import LayoutMismatchError, check_layouts
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker.wire import kv_layout
from tests.cluster_util import Cluster
from tests.engine_util import make_engine
from tests.test_worker_death import kill_while_decoding, resume

PROMPTS = {
    "a": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    "b": [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 30, 31, 32, 1, 2],
    "c": list(range(100, 141)),
}
SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
PARAMS = {
    "a": m.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
    "b": m.SamplingParams(max_tokens=17, temperature=1.0, top_k=3, seed=4, ignore_eos=True),
    "c": m.SamplingParams(
        max_tokens=30, temperature=0.0, structured=m.StructuredSpec("json", SCHEMA)
    ),
}


@pytest.fixture(scope="module")
def alone(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir)


def _spec(mode: str, tiny_dir: Path) -> SpeculativeConfig:
    if mode == "draft":  # the target drafting for itself: every draft kept, the KV must be right
        return SpeculativeConfig(mode="draft", draft_model=str(tiny_dir), switch="on")
    return SpeculativeConfig(mode="ngram", switch="on")


def _want(alone: LLMEngine, rid: str, n: int = 1) -> dict[int, list[int]]:
    params = SamplingParams(**vars(PARAMS[rid]))
    if n == 1:
        return {0: alone.generate([PROMPTS[rid]], params)[0].new_token_ids}
    seeds = [params.seed + c for c in range(n)]  # choice c draws from seed + c
    outs = alone.generate(
        [PROMPTS[rid]] * n, [SamplingParams(**{**vars(params), "seed": s}) for s in seeds]
    )
    return {c: o.new_token_ids for c, o in enumerate(outs)}


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_split_outputs_equal_one_engine(alone, tiny_dir: Path, mode: str, backend: str) -> None:
    spec = _spec(mode, tiny_dir)
    prefill = make_engine(tiny_dir, speculative=spec if mode == "draft" else SpeculativeConfig())
    decode = make_engine(tiny_dir, speculative=spec)
    cluster = Cluster([prefill], [decode], backend)
    try:
        cluster.submit("a", PROMPTS["a"], PARAMS["a"])
        cluster.pump()
        if mode == "draft":  # the draft's prompt KV moved with the target's, block for block
            _same_draft_kv(prefill, decode, PROMPTS["a"])
        for rid in ("b", "c"):
            cluster.submit(rid, PROMPTS[rid], PARAMS[rid])
        cluster.submit("n3", PROMPTS["b"], PARAMS["b"], n=3)
        cluster.pump()
        for rid in PROMPTS:
            assert cluster.tokens(rid) == _want(alone, rid), (mode, backend, rid)
        assert cluster.tokens("n3") == _want(alone, "b", n=3)
        assert set(cluster.used_blocks().values()) == {0}
        counters = decode.spec_counters()
        assert counters.steps["speculated"] > 0 and sum(counters.accepted) > 0
        if mode == "draft":
            assert counters.draft_prompt_tokens == 0  # every prompt's draft KV came with it
            assert prefill.spec_counters().draft_prompt_tokens > 0
    finally:
        cluster.close()


def _same_draft_kv(prefill: LLMEngine, decode: LLMEngine, prompt: list[int]) -> None:
    sent = prefill.block_manager.find_cached_blocks(prompt)
    landed = decode.block_manager.find_cached_blocks(prompt)
    assert len(sent) == len(landed) == (len(prompt) - 1) // 4 > 0
    layers = prefill.runner.kv_cache.draft_layers, decode.runner.kv_cache.draft_layers
    for a, b in zip(*layers, strict=True):
        assert bool(a[sent].abs().sum() > 0)
        assert bool((a[sent] == b[landed]).all())


def test_colocated_equals_one_engine(alone, tiny_dir: Path) -> None:
    decode = make_engine(tiny_dir, speculative=_spec("draft", tiny_dir))
    cluster = Cluster([], [decode], colocated=True)
    try:
        for rid in PROMPTS:
            cluster.submit(rid, PROMPTS[rid], PARAMS[rid])
        cluster.pump()
        for rid in PROMPTS:
            assert cluster.tokens(rid) == _want(alone, rid)
        assert decode.spec_counters().draft_prompt_tokens > 0  # computed here, not moved
    finally:
        cluster.close()


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_a_stream_migrates_after_its_decode_worker_dies(alone, tiny_dir: Path, mode: str) -> None:
    spec = _spec(mode, tiny_dir)
    prefill = make_engine(tiny_dir, speculative=spec if mode == "draft" else SpeculativeConfig())
    decodes = [make_engine(tiny_dir, speculative=spec) for _ in range(2)]
    cluster = Cluster([prefill], decodes)
    params = m.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS["b"]
    try:
        cluster.submit("r", prompt, params)
        so_far = kill_while_decoding(cluster)
        assert 0 < len(so_far) < 60
        whole = so_far + resume(cluster, "r", prompt, params, so_far)
        single = alone.generate([prompt], SamplingParams(**vars(params)))[0]
        assert whole == single.new_token_ids
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


def test_a_draft_worker_never_pairs_with_one_without(tiny_dir: Path) -> None:
    with_draft = make_engine(tiny_dir, speculative=_spec("draft", tiny_dir))
    without = make_engine(tiny_dir)
    assert kv_layout(with_draft).draft.endswith("2 layers none")
    with pytest.raises(LayoutMismatchError, match="draft"):
        check_layouts(kv_layout(without), kv_layout(with_draft), ("prefill", "decode"))
