"""Speculative decoding in one engine (engine/spec/): outputs equal the outputs without it,
token for token, whatever a request asks for; rejected drafts leave no KV."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.engine.config import CacheConfig, ConfigError, EngineConfig, SpeculativeConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.protocol.sampling import SamplingParams, StructuredSpec
from tests.engine_util import make_engine

# prompts whose n-grams recur (drafts to verify) and one that never repeats
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44],
    [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 30, 31, 32, 1, 2],
    list(range(100, 130)),
]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdserve.models.make_model import make_model

    return Path(make_model(tmp_path_factory.mktemp("draft") / "d", preset="tiny-draft", seed=3))


def spec_engine(model: Path, spec: SpeculativeConfig, **kw: object) -> LLMEngine:
    return make_engine(model, speculative=spec, **kw)


@pytest.fixture(scope="module")
def engines(tiny_dir: Path, draft_dir: Path) -> dict[str, LLMEngine]:
    """Without speculation; n-gram; a small random draft (mostly refused); the target as its
    own draft (always kept), each with the switch forced on."""
    return {
        "off": make_engine(tiny_dir),
        "ngram": spec_engine(tiny_dir, SpeculativeConfig(mode="ngram", switch="on")),
        "draft": spec_engine(
            tiny_dir, SpeculativeConfig(mode="draft", draft_model=str(draft_dir), switch="on")
        ),
        "self": spec_engine(
            tiny_dir, SpeculativeConfig(mode="draft", draft_model=str(tiny_dir), switch="on")
        ),
    }


SPEC = ("ngram", "draft", "self")


def run(engine: LLMEngine, params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    outs = engine.generate(PROMPTS, params)
    assert engine.status.num_used_blocks == 0, "every block free after the run"
    return outs


def same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.new_token_ids == y.new_token_ids
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        assert len(x.new_logprobs) == len(y.new_logprobs)
        for p, q in zip(x.new_logprobs, y.new_logprobs, strict=True):
            assert p.token_id == q.token_id and p.rank == q.rank
            assert p.logprob == pytest.approx(q.logprob, abs=1e-4)
            assert [t for t, _ in p.top] == [t for t, _ in q.top]


def test_ngram_proposals() -> None:
    from pdserve.engine.spec.ngram import NgramIndex

    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    assert index.propose(tokens, 3) == ([3, 5, 1], 2)  # "1 2": the latest earlier one, at 4
    assert index.propose([*tokens, 3], 2) == ([5, 1], 3)  # "1 2 3" (longest) at 4 -> 5
    assert index.propose([7, 8, 9], 4) == ([], 0)
    assert NgramIndex(1, 2).propose([4, 5, 4, 5, 4], 5) == ([5, 4, 5, 4, 5], 2)  # copies itself
    assert NgramIndex(2, 2).propose([4, 5, 6], 3) == ([], 0)


@pytest.mark.parametrize("mode", SPEC)
def test_greedy_outputs_equal_without(engines, mode: str) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    same(run(engines["off"], params), run(engines[mode], params))


@pytest.mark.parametrize("mode", SPEC)
def test_seeded_sampling_penalties_and_stops_equal_without(engines, mode: str) -> None:
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=11, top_k=20, logprobs=1),
        SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=0.5, min_tokens=5),
        SamplingParams(max_tokens=20, temperature=0.7, seed=3, repetition_penalty=1.3),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[7, 43, 120]),
    ]
    same(run(engines["off"], params), run(engines[mode], params))


@pytest.mark.parametrize("max_tokens", [2, 3, 5, 9])
def test_max_tokens_inside_an_accepted_run(engines, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    before = sum(engines["self"].spec.acceptance.accepted)
    outs = run(engines["self"], params)
    same(run(engines["off"], params), outs)
    assert all(len(o.new_token_ids) == max_tokens for o in outs)
    assert sum(engines["self"].spec.acceptance.accepted) > before or max_tokens <= 2


def test_drafts_are_kept_and_refused(engines) -> None:
    """Both paths run: the target as its own draft keeps every draft, the random one few."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_k=2, seed=1, ignore_eos=True)
    kept: dict[str, tuple[list[int], list[int]]] = {}
    for mode in SPEC:
        before = engines[mode].spec.counters()
        # the tiny model's greedy outputs repeat a token (every n-gram draft kept): sampled
        run(engines[mode], params if mode == "self" else sampled)
        after = engines[mode].spec.counters()
        drafted = [b - a for a, b in zip(before.drafted, after.drafted, strict=True)]
        accepted = [b - a for a, b in zip(before.accepted, after.accepted, strict=True)]
        kept[mode] = drafted, accepted
        assert after.steps["speculated"] > before.steps.get("speculated", 0)
    drafted, accepted = kept["self"]
    assert accepted == drafted and drafted[0] > 0
    for mode in ("ngram", "draft"):
        drafted, accepted = kept[mode]
        assert 0 < sum(accepted) < sum(drafted), mode


def test_json_schema_equal_without(engines) -> None:
    schema = '{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}'
    params = SamplingParams(
        max_tokens=30, temperature=0.0, structured=StructuredSpec("json", schema)
    )
    for mode in SPEC:
        same(run(engines["off"], params), run(engines[mode], params))


@pytest.mark.parametrize("mode", SPEC)
def test_n3_choices_equal_without(engines, mode: str) -> None:
    def choices(engine: LLMEngine) -> dict[str, list[int]]:
        ids = [f"c{i}" for i in range(3)]
        params = [SamplingParams(max_tokens=16, temperature=1.0, seed=5 + i) for i in range(3)]
        engine.forks.add_request_n("p", ids, PROMPTS[0], params)
        got: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[str(out.request_id)] += out.new_token_ids
        assert engine.status.num_used_blocks == 0
        return got

    assert choices(engines["off"]) == choices(engines[mode])


@pytest.mark.parametrize("mode", ["ngram", "self"])
def test_preemption_and_abort_free_every_block(tiny_dir: Path, draft_dir, mode: str) -> None:
    spec = SpeculativeConfig(mode="ngram", switch="on")
    if mode == "self":
        spec = SpeculativeConfig(mode="draft", draft_model=str(tiny_dir), switch="on")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # 24 blocks of 4 tokens: four streams of ~50 tokens cannot all hold theirs
    tight = spec_engine(tiny_dir, spec, num_blocks=24)
    off = make_engine(tiny_dir, num_blocks=24)
    same(run(off, params), run(tight, params))
    assert tight.status.preemptions > 0
    for i, prompt in enumerate(PROMPTS):
        tight.add_request(f"a{i}", prompt, params)
    for _ in range(4):
        tight.step()
    for i in range(len(PROMPTS)):
        tight.abort(f"a{i}")
    tight.step()
    assert not tight.has_unfinished() and tight.status.num_used_blocks == 0


def test_rejected_drafts_leave_no_blocks(tiny_dir: Path, draft_dir: Path) -> None:
    """After a verification a sequence holds the blocks its computed tokens need, no more,
    and the prefix cache holds only kept tokens' blocks."""
    spec = SpeculativeConfig(mode="draft", draft_model=str(draft_dir), switch="on")
    engine = spec_engine(tiny_dir, spec, block_size=4)
    params = SamplingParams(max_tokens=60, temperature=1.0, top_k=2, seed=2, ignore_eos=True)
    engine.add_request("r", PROMPTS[3], params)
    blocks = engine.block_manager
    for _ in range(12):
        engine.step()
        seq = engine.requests["r"]
        assert len(seq.block_table) == blocks.blocks_needed(seq.num_computed_tokens)
        assert seq.num_computed_tokens == seq.num_tokens - 1
        assert seq.num_committed_blocks * 4 <= seq.num_computed_tokens - seq.draft_lag
    c = engine.spec.counters()
    assert sum(c.accepted) < sum(c.drafted)


def test_draft_prompt_tokens_counted_locally(engines) -> None:
    engine = engines["draft"]
    before = engine.spec.counters().draft_prompt_tokens
    fresh = [200, 201, 202, 203, 204, 205, 206]  # nothing of it in the prefix cache
    engine.generate([fresh], SamplingParams(max_tokens=4, temperature=0.0))
    assert engine.spec.counters().draft_prompt_tokens - before == len(fresh)


def test_a_draft_that_cannot_pair_is_refused(tiny_dir: Path, small_dir: Path) -> None:
    with pytest.raises(ConfigError, match="KV heads x head size"):
        spec_engine(tiny_dir, SpeculativeConfig(mode="draft", draft_model=str(small_dir)))
    with pytest.raises(ConfigError, match="needs --draft-model"):
        SpeculativeConfig(mode="draft")
    with pytest.raises(ConfigError, match="tensor-parallel"):
        EngineConfig(
            model=str(tiny_dir),
            tensor_parallel_size=2,
            speculative=SpeculativeConfig(mode="draft", draft_model=str(tiny_dir)),
        )


def test_draft_kv_shares_the_budget(tiny_dir: Path) -> None:
    """A draft's KV is sized with the target's: the same bytes hold fewer blocks."""
    cache = CacheConfig(block_size=4, kv_cache_memory=1 << 20)
    alone = LLMEngine(EngineConfig(model=str(tiny_dir), cache=cache))
    spec = SpeculativeConfig(mode="draft", draft_model=str(tiny_dir))
    both = LLMEngine(replace(alone.config, speculative=spec))
    assert both.status.num_blocks == alone.status.num_blocks // 2
    assert len(both.status.kv_layers) == 2 * len(alone.status.kv_layers)


def test_ngram_in_a_tensor_parallel_group(small_dir: Path) -> None:
    """A TP-2 group's verification: rank 0 sends every position's row, the others run it."""
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[3]]
    want = make_engine(small_dir).generate(prompts, params)
    spec = SpeculativeConfig(mode="ngram", switch="on")
    group = make_engine(small_dir, tensor_parallel_size=2, threads=1, speculative=spec)
    try:
        got = group.generate(prompts, params)
        assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
        c = group.spec.counters()
        assert 0 < sum(c.accepted) < sum(c.drafted)
    finally:
        group.close()
