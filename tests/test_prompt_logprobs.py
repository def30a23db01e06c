"""Prompt logprobs: every prompt token's logprob equals transformers' log-softmax of the
prompt's logits, in the engine (chunked, batched, after a prefix-cache hit, preempted) and
through the cluster (split and colocated); ``max_tokens`` 0 runs on a prefill worker alone."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from pdserve.protocol import messages as m
from pdserve.protocol.sampling import MAX_PROMPT_LOGPROB_ENTRIES, SamplingParams
from tests.cluster_util import Cluster
from tests.engine_util import greedy, hf_greedy, hf_model, make_engine, prompts

# float32 through the same math, summed in another order: what we see is ~5e-7
BOUND = 1e-5


@functools.cache
def reference(path: Path, prompt: tuple[int, ...]) -> torch.Tensor:
    """transformers' log-softmax over the prompt's logits: row i scores token i + 1."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(dim=-1)[:-1]


def check(path: Path, prompt: list[int], got: list[m.TokenLogprob] | None, k: int) -> None:
    ref = reference(path, tuple(prompt))
    assert got is not None and len(got) == len(prompt) - 1
    targets = torch.tensor(prompt[1:])
    want = ref[torch.arange(len(targets)), targets]
    assert [lp.token_id for lp in got] == prompt[1:]
    assert (torch.tensor([lp.logprob for lp in got]) - want).abs().max() < BOUND
    ranks = (ref > want[:, None]).sum(dim=-1) + 1
    assert [lp.rank for lp in got] == ranks.tolist()
    top_vals, top_ids = ref.topk(k, dim=-1) if k else (None, None)
    for i, lp in enumerate(got):
        assert len(lp.top) == k
        if k and top_ids is not None and top_vals is not None:
            assert [t for t, _ in lp.top] == top_ids[i].tolist()
            assert (
                max(abs(v - w) for (_, v), w in zip(lp.top, top_vals[i].tolist(), strict=True))
                < BOUND
            )


@pytest.mark.parametrize("budget", [2048, 16])  # whole prompts, or chunks of 16 tokens
def test_engine_prompt_logprobs_equal_transformers(tiny_dir, budget) -> None:
    engine = make_engine(tiny_dir, max_num_batched_tokens=budget)
    batch = prompts(engine.model_config.vocab_size, [2, 9, 33, 60], seed=5)
    params = [greedy(3, prompt_logprobs=k) for k in (0, 1, 5, 20)]
    outs = engine.generate([*batch, batch[0]], [*params, greedy(3)])  # one not scored
    for p, out, k in zip(batch, outs, (0, 1, 5, 20), strict=False):
        check(tiny_dir, p, out.prompt_logprobs, k)
        assert out.new_token_ids == hf_greedy(tiny_dir, p, 3)  # the output is as without
    assert outs[-1].prompt_logprobs is None
    assert engine.block_manager.num_used_blocks == 0


def test_a_prefix_cache_hit_is_recomputed_for_its_scores(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    prompt = prompts(engine.model_config.vocab_size, [40], seed=7)[0]
    engine.generate([prompt], greedy(2))  # the prompt's blocks are in the prefix cache now
    hits = engine.scheduler.prefix_hit_tokens
    [plain] = engine.generate([prompt], greedy(2))
    assert plain.num_cached_tokens > 0 and engine.scheduler.prefix_hit_tokens > hits
    hits = engine.scheduler.prefix_hit_tokens
    [scored] = engine.generate([prompt], greedy(2, prompt_logprobs=2))
    assert engine.scheduler.prefix_hit_tokens == hits  # none taken: every position computed
    check(tiny_dir, prompt, scored.prompt_logprobs, 2)
    assert scored.new_token_ids == plain.new_token_ids


def test_max_tokens_0_scores_the_prompt_and_ends_with_no_token(tiny_dir) -> None:
    engine = make_engine(tiny_dir, max_num_batched_tokens=16)
    prompt = prompts(engine.model_config.vocab_size, [37], seed=2)[0]
    [out] = engine.generate([prompt], greedy(0, prompt_logprobs=1))
    assert (out.new_token_ids, out.finish_reason, out.finished) == ([], m.FinishReason.LENGTH, True)
    check(tiny_dir, prompt, out.prompt_logprobs, 1)
    assert engine.block_manager.num_used_blocks == 0


def test_preempted_scores_are_not_repeated(tiny_dir) -> None:
    """Too few blocks for both: one is preempted and recomputed; its scores come once."""
    engine = make_engine(tiny_dir, num_blocks=24, max_num_batched_tokens=16, prefix_caching=False)
    batch = prompts(engine.model_config.vocab_size, [30, 30], seed=9)
    outs = engine.generate(batch, [greedy(40, prompt_logprobs=0)] * 2)
    assert engine.scheduler.preemptions > 0
    for p, out in zip(batch, outs, strict=True):
        check(tiny_dir, p, out.prompt_logprobs, 0)
        assert out.new_token_ids == hf_greedy(tiny_dir, p, 40)


def test_bounds() -> None:
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21)
    params = SamplingParams(prompt_logprobs=20)
    params.check_prompt_logprobs(MAX_PROMPT_LOGPROB_ENTRIES // 21 + 1)
    with pytest.raises(ValueError, match="over the limit of 65536"):
        params.check_prompt_logprobs(MAX_PROMPT_LOGPROB_ENTRIES // 21 + 2)


def test_n_choices_are_refused(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    p = SamplingParams(max_tokens=2, prompt_logprobs=0)
    with pytest.raises(ValueError, match="one choice"):
        engine.forks.add_request_n("p", ["a", "b"], [1, 2, 3], [p, p])
    with pytest.raises(ValueError, match="one choice"):
        engine.requests.check_prompt([1, 2, 3], p, choices=2)


# ---- through the cluster --------------------------------------------------------------------


@pytest.fixture
def clusters(tiny_dir):
    made: list[Cluster] = []

    def make(colocated: bool = False) -> Cluster:
        p = [] if colocated else [make_engine(tiny_dir, max_num_batched_tokens=16)]
        c = Cluster(p, [make_engine(tiny_dir)], colocated=colocated)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _scored(cluster: Cluster, request_id: str) -> list[m.TokenChunk]:
    return [c for c in cluster.chunks() if c.request_id == request_id and c.prompt_logprobs]


@pytest.mark.parametrize("colocated", [False, True])
def test_across_the_split_and_colocated(clusters, tiny_dir, colocated) -> None:
    cluster = clusters(colocated)
    batch = prompts(512, [5, 29], seed=11)
    for i, p in enumerate(batch):
        cluster.submit(f"r{i}", p, greedy(4, prompt_logprobs=3))
    cluster.pump()
    for i, p in enumerate(batch):
        assert cluster.tokens(f"r{i}") == {0: hf_greedy(tiny_dir, p, 4)}
        [chunk] = _scored(cluster, f"r{i}")  # once, with token 0
        assert chunk.index == 0
        check(tiny_dir, p, chunk.prompt_logprobs, 3)
    assert set(cluster.used_blocks().values()) == {0}
    assert cluster.coordinator.routes == {}


def test_max_tokens_0_reserves_no_decode_blocks(clusters, tiny_dir) -> None:
    cluster = clusters()
    prompt = prompts(512, [21], seed=13)[0]
    cluster.submit("r0", prompt, greedy(0, prompt_logprobs=0))
    sent: list[tuple[str, m.Message]] = []
    for _ in range(2000):  # pump, noting every message for the workers
        while cluster.bus.queue:
            sent.append(cluster.bus.queue[0])
            cluster.deliver_next()
        if not any([w.step() for w in cluster.workers.values()]) and not cluster.bus.queue:
            break
    assert not any(isinstance(x, m.Reserve) for _, x in sent)
    assert [d for d, x in sent if isinstance(x, m.PrefillJob)] == ["p0"]
    [chunk] = cluster.chunks()
    assert (chunk.token_ids, chunk.finished, chunk.finish_reason) == ([], True, "length")
    check(tiny_dir, prompt, chunk.prompt_logprobs, 0)
    assert cluster.workers["d0"].engine.block_manager.num_used_blocks == 0
    assert set(cluster.used_blocks().values()) == {0}
    assert cluster.coordinator.routes == {}
    assert cluster.coordinator.decisions["scored"] == 1
