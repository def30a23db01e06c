"""Decode-side prefix reuse: a decode worker shares the prompt blocks its prefix cache holds,
so the prefill worker moves only the rest (a chat's second turn moves only its new blocks)."""

from __future__ import annotations

import pytest

from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from tests.cluster_util import Cluster
from tests.engine_util import hf_greedy, make_engine, prompts

SPEC = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def cached_tokens(cluster: Cluster, request_id: str) -> int:
    [last] = [c for c in cluster.chunks() if c.request_id == request_id and c.finished]
    return last.num_cached_tokens


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_second_turn_moves_only_its_new_blocks(tiny_dir, backend: str) -> None:
    # blocks of 4 tokens
    cluster = Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir)], backend=backend)
    prefill = cluster.workers["p0"]
    try:
        first = prompts(512, [21], seed=60)[0]
        cluster.submit("turn1", first, SPEC)
        cluster.pump()
        answer = cluster.tokens("turn1")[0]
        assert answer == hf_greedy(tiny_dir, first, 8)
        assert prefill.blocks_sent == 6  # 21 tokens: every block moves
        # the decode worker computed 28 of those 29 tokens' KV: 7 full blocks in its cache
        second = first + answer + prompts(512, [10], seed=61)[0]  # 39 tokens, 10 blocks
        cluster.submit("turn2", second, SPEC)
        cluster.pump()
        assert cluster.tokens("turn2") == {0: hf_greedy(tiny_dir, second, 8)}
        assert prefill.blocks_sent - 6 == 3  # only blocks 8..10 moved
        assert cached_tokens(cluster, "turn2") == 28
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_a_fully_cached_prompt_still_moves_its_last_block(tiny_dir, backend: str) -> None:
    """The last prompt token's logits must be computed: its block always moves."""
    cluster = Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir)], backend=backend)
    prefill = cluster.workers["p0"]
    try:
        prompt = prompts(512, [16], seed=62)[0]  # exactly 4 blocks
        for i in range(2):
            cluster.submit(f"r{i}", prompt, SPEC)
            cluster.pump()
            assert cluster.tokens(f"r{i}") == {0: hf_greedy(tiny_dir, prompt, 8)}
        assert prefill.blocks_sent == 4 + 1
        assert cached_tokens(cluster, "r1") == 12
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


def test_a_reservation_keeps_its_cached_blocks_from_eviction(tiny_dir) -> None:
    """Blocks shared by a reservation are referenced: aborting it gives them back cached."""
    engine = make_engine(tiny_dir, num_blocks=16)
    prompt = prompts(512, [13], seed=63)[0]
    engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    bm = engine.block_manager
    cached_before = bm.num_cached_blocks
    ids, hits = engine.handoff.reserve_prompt("r", prompt)
    assert hits == 3 and len(ids) == 4  # 13 + 1 tokens: 3 shared, 1 fresh
    assert all(bm.ref_counts[b] == 1 for b in ids)
    engine.handoff.cancel_reservation("r")
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == cached_before
