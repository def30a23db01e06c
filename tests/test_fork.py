"""n choices of one prompt computed here (engine/fork.py ``add_request_n``): the prompt runs
once, its full blocks are shared by reference, its partial tail copied per choice, and each
choice's tokens equal a request of its own. Blocks of 4 tokens: a 10-token prompt is two full
blocks and a partial one, an 8-token prompt two full blocks."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockManager
from tests.engine_util import greedy, hf_greedy, make_engine, run_all
from tests.fork_util import (
    IDS,
    N,
    assert_same,
    prompt_of,
    refs,
    same_kv,
    seeded,
    separate,
    tables,
)

# ---- block manager ---------------------------------------------------------------------------


def test_share_adds_a_reference_and_refuses_a_free_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_blocks(3) == [0, 1, 2]
    bm.share([0, 1])
    assert bm.ref_counts[:3] == [2, 2, 1]
    bm.free_blocks([0, 1, 2])
    assert bm.ref_counts[:3] == [1, 1, 0] and bm.num_used_blocks == 2
    bm.free_blocks([0, 1])
    assert bm.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="block 5 is free"):
        bm.share([5])


# ---- colocated: prefill once here, fork, decode ---------------------------------------------


@pytest.mark.parametrize(
    ("length", "after_token0", "after_token1", "used"),
    [
        # partial tail: "a" keeps the prompt's blocks, "b" and "c" get copies of block 2
        (10, [[0, 1, 2], [0, 1, 3], [0, 1, 4]], [[0, 1, 2], [0, 1, 3], [0, 1, 4]], [3, 3, 1, 1, 1]),
        # whole blocks: all shared, each takes a block of its own for token 0
        (8, [[0, 1], [0, 1], [0, 1]], [[0, 1, 2], [0, 1, 3], [0, 1, 4]], [3, 3, 1, 1, 1]),
    ],
)
def test_colocated_fork_shares_full_blocks_and_copies_the_tail(
    tiny_dir, length: int, after_token0, after_token1, used
) -> None:
    engine = make_engine(tiny_dir)
    prompt = prompt_of(engine, length)
    engine.forks.add_request_n("p", IDS, prompt, [greedy(6)] * N)
    outs = engine.step()
    assert [(o.request_id, len(o.new_token_ids)) for o in outs] == [(i, 1) for i in IDS]
    assert tables(engine, IDS) == after_token0
    assert "p" not in engine.requests
    if length % 4:
        assert same_kv(engine, 2, 3, 2) and same_kv(engine, 2, 4, 2)
        assert not same_kv(engine, 2, 5, 2)  # the check sees a difference where there is one
    second = {o.request_id: o for o in engine.step()}
    assert tables(engine, IDS) == after_token1
    assert refs(engine, range(6)) == [*used, 0]
    rest = run_all(engine)
    assert engine.block_manager.num_used_blocks == 0
    want = hf_greedy(tiny_dir, prompt, 6)
    for first in outs:
        i = first.request_id
        assert first.new_token_ids + second[i].new_token_ids + rest[i].new_token_ids == want


def test_colocated_fork_equals_separate_greedy_requests_and_computes_the_prompt_once(
    tiny_dir,
) -> None:
    engine = make_engine(tiny_dir)
    computed: list[int] = []
    prepare = engine.runner.prepare
    engine.runner.prepare = lambda seqs, n: (computed.append(sum(n)), prepare(seqs, n))[1]
    for length in (10, 8, 13):
        prompt = prompt_of(engine, length)
        computed.clear()
        engine.forks.add_request_n(f"p{length}", IDS, prompt, [greedy(6, logprobs=2)] * N)
        got = run_all(engine)
        assert sum(computed) == length + N * 5  # the prompt once, then tokens 0..4 per choice
        want = separate(tiny_dir, prompt, [greedy(6, logprobs=2)] * N)
        assert_same([got[i] for i in IDS], want)
        assert want[0].new_token_ids == hf_greedy(tiny_dir, prompt, 6)
        assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("length", [10, 8])
def test_colocated_seeded_choices_equal_requests_seeded_seed_plus_c(tiny_dir, length: int) -> None:
    engine = make_engine(tiny_dir)
    prompt = prompt_of(engine, length)
    params = [seeded(c, logprobs=2) for c in range(N)]
    engine.forks.add_request_n("p", IDS, prompt, params)
    got = run_all(engine)
    want = separate(tiny_dir, prompt, params)
    assert_same([got[i] for i in IDS], want)
    assert len({tuple(o.new_token_ids) for o in want}) == N  # each has its own draws
    assert engine.block_manager.num_used_blocks == 0


def test_no_free_block_for_a_tail_copy_recomputes_that_choice(tiny_dir) -> None:
    engine = make_engine(tiny_dir, num_blocks=4)
    prompt = prompt_of(engine, 10)
    params = [seeded(c, max_tokens=2) for c in range(N)]
    engine.forks.add_request_n("p", IDS, prompt, params)
    engine.step()
    assert tables(engine, IDS) == [[0, 1, 2], [0, 1, 3], []]
    assert engine.requests["c"].num_computed_tokens == 0
    assert refs(engine, range(4)) == [2, 2, 1, 1]
    rest = run_all(engine)
    assert [rest[i].new_token_ids for i in IDS] == [
        o.new_token_ids[1:] for o in separate(tiny_dir, prompt, params)
    ]
    assert engine.block_manager.num_used_blocks == 0


def test_abort_before_token0_drops_that_choice_and_the_prompt_with_the_last(tiny_dir) -> None:
    # the prompt takes three steps; no prefix cache, so it takes them each time
    engine = make_engine(tiny_dir, max_num_batched_tokens=4, prefix_caching=False)
    prompt = prompt_of(engine, 10)
    engine.forks.add_request_n("p", IDS, prompt, [greedy(4)] * N)
    engine.step()
    assert engine.abort("b")
    got = run_all(engine)
    assert got["b"].finish_reason == "abort" and got["b"].new_token_ids == []
    want = hf_greedy(tiny_dir, prompt, 4)
    assert got["a"].new_token_ids == got["c"].new_token_ids == want
    assert "p" not in got and engine.block_manager.num_used_blocks == 0

    # every choice aborted: the prompt goes at once, blocks freed, nothing reports for it
    engine.forks.add_request_n("p", IDS, prompt, [greedy(4)] * N)
    engine.step()
    assert engine.block_manager.num_used_blocks == 1  # block 0 only, tokens 0..3 computed
    for i in IDS:
        assert engine.abort(i)
    assert engine.block_manager.num_used_blocks == 0 and "p" not in engine.requests
    got = run_all(engine)
    assert sorted(got) == IDS and {o.finish_reason for o in got.values()} == {"abort"}

    # the prompt's id aborts it with every choice
    engine.forks.add_request_n("p", IDS, prompt, [greedy(4)] * N)
    engine.step()
    assert engine.abort("p")
    assert engine.requests == {} and engine.block_manager.num_used_blocks == 0
    assert {o.finish_reason for o in run_all(engine).values()} == {"abort"}


def test_bad_calls_are_refused_and_leave_nothing(tiny_dir) -> None:
    engine = make_engine(tiny_dir)
    with pytest.raises(ValueError, match="repeat"):
        engine.forks.add_request_n("p", ["a", "a"], [1, 2], [greedy(2)] * 2)
    with pytest.raises(ValueError, match="already running"):
        engine.forks.add_request_n("a", ["a", "b"], [1, 2], [greedy(2)] * 2)
    with pytest.raises(ValueError, match="lengths"):
        engine.forks.add_request_n("p", ["a", "b"], [1, 2], [greedy(2)])
    assert engine.requests == {} and not engine.has_unfinished()
