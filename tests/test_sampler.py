"""Sampler: exact penalty arithmetic, truncation masks, seeds, stops and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.sampler import Sampler, _top_k_top_p
from pdserve.engine.scheduler import Sequence
from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams
from tests.engine_util import greedy, hf_greedy, hf_last_logits, make_engine, prompts, run_all


def seq(prompt: list[int], output: list[int], **params: object) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**params))
    s.token_ids += output
    return s


def test_penalties_exact_values() -> None:
    sampler = Sampler(torch.device("cpu"), 0, eos_token_ids=[])
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    s = seq([0], [1, 1, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = sampler._apply_penalties(logits.clone(), [s])
    # token 0: prompt -> 2/2 = 1; token 1: twice in output -> -2*2 - 0.5*2 - 0.25 = -5.25
    # token 2: once -> 1/2 - 0.5 - 0.25 = -0.25; tokens 3, 4 untouched
    torch.testing.assert_close(out, torch.tensor([[1.0, -5.25, -0.25, 0.5, 3.0]]))


def test_penalty_counts_kept_across_steps_equal_a_recount() -> None:
    sampler = Sampler(torch.device("cpu"), 0, eos_token_ids=[])
    logits = torch.randn(1, 7)
    kw = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    kept = seq([0, 5], [1], **kw)
    for new in ([2], [1, 3], [], [6]):  # steps append tokens; the state catches up with them
        kept.token_ids += new
        fresh = seq([0, 5], kept.output_token_ids, **kw)
        got = sampler._apply_penalties(logits.clone(), [kept])
        assert torch.equal(got, sampler._apply_penalties(logits.clone(), [fresh]))
    assert kept.penalty.num_counted == 5 and kept.penalty.counts.tolist()[1] == 2.0


def test_min_tokens_bans_eos_and_stop_tokens() -> None:
    sampler = Sampler(torch.device("cpu"), 0, eos_token_ids=[4])
    logits = torch.zeros(1, 5)
    s = seq([0], [1], min_tokens=3, stop_token_ids=[2])
    out = sampler._apply_penalties(logits.clone(), [s])
    assert out[0].tolist() == [0.0, 0.0, -math.inf, 0.0, -math.inf]


def test_top_k_top_p_masks() -> None:
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    logits = probs.log()
    # top_p 0.7: keep 0.5 and 0.25 (mass before 0.15 is 0.75 >= 0.7)
    out = _top_k_top_p(logits, [0], [0.7])
    assert torch.isinf(out[0]).tolist() == [True, False, True, False]
    out = _top_k_top_p(logits, [1], [1.0])
    assert torch.isinf(out[0]).tolist() == [True, False, True, True]
    out = _top_k_top_p(logits, [3], [1.0])
    assert torch.isinf(out[0]).tolist() == [True, False, False, False]


def test_sampling_respects_truncation() -> None:
    sampler = Sampler(torch.device("cpu"), 0, eos_token_ids=[])
    logits = torch.tensor([0.1, 0.5, 0.15, 0.25]).log().repeat(200, 1)
    seqs = [seq([0], [], temperature=1.0, top_p=0.7, seed=i) for i in range(100)]
    seqs += [seq([0], [], temperature=1.0, min_p=0.45) for _ in range(100)]
    for s in seqs:
        if s.params.seed is not None:
            s.generator = sampler.make_generator(s.params.seed)
    tokens = sampler(logits, seqs).token_ids
    assert set(tokens[:100]) == {1, 3}
    assert set(tokens[100:]) == {1, 3}  # min_p 0.45 * 0.5 = 0.225 drops 0.1 and 0.15
    assert tokens[:100].count(1) > tokens[:100].count(3)


def test_seeded_request_same_whatever_the_batch(tiny_dir) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    engine = make_engine(tiny_dir)
    vocab = engine.model_config.vocab_size
    target, *others = prompts(vocab, [9, 3, 17, 30], seed=6)
    alone = engine.generate([target], params)[0].new_token_ids
    other_params = SamplingParams(max_tokens=7, temperature=0.8, ignore_eos=True)
    mixed = engine.generate(
        [*others[:2], target, others[2]], [other_params, other_params, params, other_params]
    )[2].new_token_ids
    assert alone == mixed
    different = engine.generate(
        [target], SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    )[0].new_token_ids
    assert different != alone


def test_top_k_one_equals_greedy(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    batch = prompts(engine.model_config.vocab_size, [5, 12], seed=7)
    sampled = engine.generate(
        batch, SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True)
    )
    for p, out in zip(batch, sampled, strict=True):
        assert out.new_token_ids == hf_greedy(tiny_dir, p, 8)


def test_stop_token_and_max_tokens(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    prompt = prompts(engine.model_config.vocab_size, [6], seed=8)[0]
    ref = hf_greedy(tiny_dir, prompt, 8)
    stop_at = ref[4]
    out = engine.generate([prompt], greedy(8, stop_token_ids=[stop_at]))[0]
    assert out.new_token_ids == ref[: ref.index(stop_at) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    out = engine.generate([prompt], greedy(3))[0]
    assert out.new_token_ids == ref[:3] and out.finish_reason == "length"


def test_eos_ends_a_request_unless_ignored(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    prompt = prompts(engine.model_config.vocab_size, [6], seed=8)[0]
    ref = hf_greedy(tiny_dir, prompt, 8)
    engine.requests.eos_token_ids = engine.sampler.eos_token_ids = [ref[2]]
    out = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.new_token_ids == ref[: ref.index(ref[2]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = engine.generate([prompt], greedy(8))[0]
    assert out.new_token_ids == ref


def test_logprobs_match_transformers(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    prompt = prompts(engine.model_config.vocab_size, [11], seed=9)[0]
    engine.add_request("r", prompt, greedy(1, logprobs=3))
    lp = run_all(engine)["r"].new_logprobs[0]
    assert type(lp) is TokenLogprob  # the wire's own type: the workers pass it on as it is
    ref = hf_last_logits(tiny_dir, prompt).log_softmax(-1)
    top = ref.topk(3)
    assert lp.token_id == int(ref.argmax()) and lp.rank == 1
    assert lp.logprob == pytest.approx(float(ref.max()), abs=1e-4)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    for (_, value), expected in zip(lp.top, top.values.tolist(), strict=True):
        assert value == pytest.approx(expected, abs=1e-4)


def test_invalid_params_are_rejected() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def _top_k_top_p_by_sorting(logits: torch.Tensor, top_k: list[int], top_p: list[float]):
    """The reference: a full sort of every row (what the sampler did before)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([t if t > 0 else vocab for t in top_k])
    cut = torch.arange(vocab)[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(dim=-1)
    p = torch.tensor([v if v < 1.0 else float("inf") for v in top_p])
    cut |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(cut, -torch.inf))


def test_top_k_top_p_without_a_full_sort_keeps_exactly_what_sorting_keeps() -> None:
    from pdserve.engine.sampler import _top_k_top_p

    g = torch.Generator().manual_seed(0)
    vocab = 5000
    # peaked rows settle among 64 candidates; flat ones need 16x more or the whole row
    scales = [8.0, 3.0, 0.5, 0.01, 8.0, 1.0, 0.1, 2.0]
    logits = torch.cat([torch.randn(1, vocab, generator=g) * s for s in scales])
    top_k = [0, 50, 0, 0, 3000, 0, 7, 0]
    top_p = [0.9, 0.95, 0.99, 0.5, 1.0, 1.0, 0.3, 1.0]
    got = _top_k_top_p(logits, top_k, top_p)
    want = _top_k_top_p_by_sorting(logits, top_k, top_p)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], want[~want.isinf()])
    kept = (~got.isinf()).sum(dim=-1).tolist()
    assert kept[4] == 3000 and kept[6] <= 7 and kept[5] == kept[7] == vocab  # untouched rows
    assert 64 < kept[2] < vocab  # a flat row whose cut lies past the first candidates
