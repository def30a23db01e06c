"""n choices of one prompt prefilled on one engine and forked on another (engine/fork.py
``add_request_n(hold_kv=True)``, ``reserve(choices=n)``, ``add_prefilled_n``): exact blocks,
aborts, preemption and output constraints per choice; each choice's tokens equal a request of
its own. KV moves by a plain tensor copy, as in tests/test_kv_handoff.py."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pdserve.protocol import messages as m
from tests.engine_util import greedy, make_engine, run_all
from tests.fork_util import (
    IDS,
    N,
    assert_same,
    hand_off,
    joined,
    prefill_n,
    prompt_of,
    refs,
    same_kv,
    seeded,
    separate,
    tables,
)

# ---- disaggregated: prefill once there, fork here ---------------------------------------------


@pytest.mark.parametrize("length", [10, 8])
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_disaggregated_fork_equals_separate_requests(tiny_dir, kind: str, length: int) -> None:
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    prompt = prompt_of(prefill, length)
    if kind == "greedy":
        params = [greedy(8, logprobs=2)] * N
    else:
        params = [seeded(c, logprobs=2) for c in range(N)]
    want = separate(tiny_dir, prompt, params)
    token0 = prefill_n(prefill, prompt, params)
    assert [o.new_token_ids for o in token0] == [o.new_token_ids[:1] for o in want]
    assert {o.finish_reason for o in token0} == {"length"}
    # the prefill side holds the prompt's blocks only: no tail copies for choices that end
    assert prefill.handoff.held_block_ids("r") == [0, 1, 2][: -(-length // 4)]
    assert prefill.block_manager.num_used_blocks == -(-length // 4)

    dst = hand_off(prefill, decode, token0, prompt, params)
    assert dst == [0, 1, 2, 3, 4]  # 3 blocks for the prompt and token 0, one per other choice
    assert prefill.block_manager.num_used_blocks == 0
    assert tables(decode, IDS) == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert refs(decode, range(6)) == [3, 3, 1, 1, 1, 0]
    if length % 4:
        assert same_kv(decode, 2, 3, 2) and same_kv(decode, 2, 4, 2)
    assert_same(joined(token0, run_all(decode)), want)
    assert decode.block_manager.num_used_blocks == 0


def test_abort_one_choice_frees_what_it_alone_holds_then_all(tiny_dir) -> None:
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    prompt = prompt_of(prefill, 10)
    params = [greedy(8)] * N
    hand_off(prefill, decode, prefill_n(prefill, prompt, params), prompt, params)
    decode.step()
    assert refs(decode, range(6)) == [3, 3, 1, 1, 1, 0]
    assert decode.abort("b")
    assert refs(decode, range(6)) == [2, 2, 1, 0, 1, 0]
    assert next(iter(decode.block_manager.free)) == 3  # its tail is the first to go again
    out = {o.request_id: o for o in decode.step()}
    assert out["b"].finish_reason == "abort" and not out["a"].finished
    assert decode.abort("a") and decode.abort("c")
    assert decode.block_manager.num_used_blocks == 0
    assert {o.finish_reason for o in run_all(decode).values()} == {"abort"}


def test_reservation_surplus_is_freed_and_a_shortfall_refused(tiny_dir) -> None:
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir)
    prompt = prompt_of(prefill, 10)
    token0 = prefill_n(prefill, prompt, [greedy(4)] * N)
    assert decode.handoff.reserve("r", 11, choices=N) == [0, 1, 2, 3, 4]
    # choice "c" aborted while the KV was on its way: its block goes back
    decode.handoff.add_prefilled_n(
        "r", IDS[:2], prompt, [o.new_token_ids[0] for o in token0[:2]], [greedy(4)] * 2
    )
    assert tables(decode, IDS[:2]) == [[0, 1, 2], [0, 1, 3]]
    assert decode.block_manager.num_used_blocks == 4 and decode.block_manager.ref_counts[4] == 0
    run_all(decode)
    assert decode.block_manager.num_used_blocks == 0

    decode.handoff.reserve("r", 11)  # one choice's worth
    with pytest.raises(ValueError, match="need 5 reserved blocks"):
        decode.handoff.add_prefilled_n("r", IDS, prompt, [7] * N, [greedy(4)] * N)
    assert "r" not in decode.scheduler.waiting_for_kvs and decode.block_manager.num_used_blocks == 0


def test_choices_ending_at_token0_free_their_blocks_at_once(tiny_dir) -> None:
    decode = make_engine(tiny_dir)
    decode.handoff.reserve("r", 11, choices=N)
    stop = dataclasses.replace(greedy(4), stop_token_ids=[9])
    decode.handoff.add_prefilled_n(
        "r", IDS, list(range(10)), [5, 9, 5], [greedy(4), stop, greedy(1)]
    )
    # "b" stopped on token 0, "c" wanted one token: only "a" holds blocks
    assert refs(decode, range(5)) == [1, 1, 1, 0, 0]
    out = {o.request_id: o for o in decode.step()}
    assert (out["b"].finish_reason, out["c"].finish_reason) == ("stop", "length")
    assert out["b"].finish_reason is m.FinishReason.STOP
    assert out["c"].finish_reason is m.FinishReason.LENGTH
    run_all(decode)
    assert decode.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("where", ["colocated", "disaggregated"])
def test_preempted_forks_recompute_from_their_own_tokens(tiny_dir, where: str) -> None:
    # each choice needs 7 blocks for 26 tokens, 17 together with the prompt's 2 shared: 12
    # blocks force preemptions
    params = [seeded(c, max_tokens=16) for c in range(N)]
    engine = make_engine(tiny_dir, num_blocks=12)
    prompt = prompt_of(engine, 10)
    preempted: list[str] = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq, batch: (
        preempted.append(seq.request_id),
        preempt(seq, batch),
    )
    if where == "colocated":
        engine.forks.add_request_n("p", IDS, prompt, params)
        got = run_all(engine)
        got = [got[i] for i in IDS]
    else:
        prefill = make_engine(tiny_dir)
        token0 = prefill_n(prefill, prompt, params)
        hand_off(prefill, engine, token0, prompt, params)
        got = joined(token0, run_all(engine))
    assert preempted and set(preempted) <= set(IDS)
    assert_same(got, separate(tiny_dir, prompt, params))
    assert engine.block_manager.num_used_blocks == 0


# ---- structured outputs, one matcher per choice ------------------------------------------------

REGEX = r"[a-z]{3,6}-[0-9]{2}"


@pytest.mark.parametrize("where", ["colocated", "disaggregated"])
def test_structured_choices_each_follow_their_own_matcher(tiny_dir, tok, where: str) -> None:
    spec = m.StructuredSpec("regex", REGEX)
    params = [seeded(c, max_tokens=40, structured=spec) for c in range(N)]
    params = [dataclasses.replace(p, ignore_eos=False) for p in params]
    prompt = tok.encode("a prompt of a few words")
    engine = make_engine(tiny_dir)
    if where == "colocated":
        engine.forks.add_request_n("p", IDS, prompt, params)
        got = run_all(engine)
        got = [got[i] for i in IDS]
    else:
        prefill = make_engine(tiny_dir)
        token0 = prefill_n(prefill, prompt, params)
        hand_off(prefill, engine, token0, prompt, params)
        got = joined(token0, run_all(engine))
    want = separate(tiny_dir, prompt, params)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    texts = [tok.decode(o.new_token_ids) for o in got]
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert len(set(texts)) > 1
    assert engine.block_manager.num_used_blocks == 0
