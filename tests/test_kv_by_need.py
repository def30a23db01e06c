"""KV by need, not by promise: ``max_tokens`` books no memory; a sequence grows as it decodes,
and when a step cannot get a block the scheduler preempts by policy (lowest tier, then lowest
priority, then newest) and recomputes exactly. Engine, scheduler and in-process cluster."""

from __future__ import annotations

import time

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.output_lengths import OutputLengths
from pdserve.engine.scheduler import Scheduler, Sequence, SequenceStatus
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tenancy import Share, Tier
from tests.cluster_util import Cluster
from tests.engine_util import greedy, make_engine, prompts
from tests.worker_util import assert_engine_empty

LENGTHS = [5, 9, 13, 3, 17, 8, 11, 6, 14, 4, 10, 7, 12, 15, 2, 16]  # 16 streams


def alone(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    [out] = engine.generate([prompt], params)
    return out.new_token_ids


# ---- the engine -------------------------------------------------------------------------------


def test_sixteen_streams_several_times_the_cache_finish_exact(tiny_dir) -> None:
    # 24 blocks of 4 tokens = 96 tokens; 16 streams of ~10 + 40 tokens want ~800
    small = make_engine(tiny_dir, num_blocks=24)
    big = make_engine(tiny_dir, num_blocks=512)
    batch = prompts(512, LENGTHS, seed=5)
    params = greedy(40)
    outs = small.generate(batch, params)
    assert small.status.preemptions > 0 and small.recomputed_tokens > 0
    for prompt, out in zip(batch, outs, strict=True):
        assert out.new_token_ids == alone(big, prompt, params)
        assert out.finish_reason is m.FinishReason.LENGTH
    assert_engine_empty(small)


def test_a_prompt_longer_than_the_cache_is_refused_with_the_numbers(tiny_dir) -> None:
    engine = make_engine(tiny_dir, num_blocks=8)  # 32 tokens
    engine.add_request("fits", list(range(30)), greedy(500))  # max_tokens books nothing
    with pytest.raises(ValueError, match=r"the prompt \(32 tokens, 1 choice\(s\)\) needs 36 "):
        engine.add_request("big", list(range(32)), greedy(1))
    engine.abort("fits")
    engine.step()
    assert_engine_empty(engine)


def test_a_sequence_as_long_as_the_cache_ends_with_length(tiny_dir) -> None:
    engine = make_engine(tiny_dir, num_blocks=8)  # 32 tokens: less than max_tokens asks
    [out] = engine.generate([list(range(1, 11))], greedy(100))
    assert out.finish_reason is m.FinishReason.LENGTH
    assert out.num_prompt_tokens + out.num_output_tokens == 32
    assert_engine_empty(engine)


def test_output_lengths_are_learned_and_growth_estimated(tiny_dir) -> None:
    engine = make_engine(tiny_dir, num_blocks=512)
    assert engine.status.expected_output_tokens == 0 and engine.status.growth_blocks == 0
    engine.generate(prompts(512, [6, 7, 8]), greedy(12))
    assert engine.status.expected_output_tokens == 12
    engine.add_request("r", list(range(1, 9)), greedy(100))  # 8 tokens: 2 blocks
    engine.step()  # prompt computed (2 blocks held), token 0 sampled: 9 tokens
    # 11 more expected (12 like the others): 20 tokens, 5 blocks
    assert engine.status.growth_blocks == 5 - 2


def test_the_conditional_mean_of_longer_outputs() -> None:
    lengths = OutputLengths(block_size=4, max_seq_tokens=1000)
    assert lengths.remaining(0, 100, 10) == 0  # nothing learned: what is used now
    for n in (10, 10, 50):
        lengths.finished(n)
    assert lengths.expected_output() == 23
    assert lengths.remaining(0, 100, 10) == 23
    assert lengths.remaining(20, 100, 30) == 30  # past the short ones: as the long one ran
    assert lengths.remaining(20, 40, 30) == 20  # never past max_tokens
    assert lengths.remaining(60, 100, 70) == 4  # past them all: a block more
    assert lengths.remaining(0, 100, 998) == 2  # never past the cache


# ---- the scheduler: who is preempted ---------------------------------------------------------


def _seq(name: str, tier: Tier = Tier.STANDARD, priority: int = 0) -> Sequence:
    share = Share(tenant="t", tier=tier, weight=1, priority=priority)
    return Sequence(name, list(range(4)), SamplingParams(max_tokens=20), share=share)


def _run(sched: Scheduler, batch) -> None:
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


@pytest.mark.parametrize(
    ("shares", "victim"),
    [
        ({}, "c"),  # all alike: the newest
        ({"a": (Tier.BATCH, 0)}, "a"),  # the lowest tier, though the oldest
        ({"b": (Tier.STANDARD, 5)}, "b"),  # the lowest priority (highest value)
        ({"c": (Tier.PREMIUM, 0), "b": (Tier.BATCH, 0)}, "b"),
    ],
)
def test_a_step_short_of_blocks_preempts_by_tier_priority_then_age(shares, victim) -> None:
    blocks = BlockManager(6, 4, False)  # three 4-token prompts fill 3 blocks, tokens 0 three more
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), blocks)
    seqs = {name: _seq(name, *shares.get(name, (Tier.STANDARD, 0))) for name in "abc"}
    for s in seqs.values():
        sched.add(s)
    _run(sched, sched.schedule())  # prompts: 3 blocks
    _run(sched, sched.schedule())  # token 0 of each: 6 blocks, none free
    assert blocks.num_free_blocks == 0
    for s in seqs.values():  # fill each one's second block, so the next token needs a third
        s.token_ids += [7, 7, 7]
        s.num_computed_tokens += 3
    batch = sched.schedule()
    assert [s.request_id for s in batch.preempted] == [victim]
    assert seqs[victim].status is SequenceStatus.WAITING and seqs[victim].block_table == []
    assert sched.preemptions == 1


def test_sequences_holding_blocks_while_waiting_give_them_up_when_nothing_can_run() -> None:
    blocks = BlockManager(4, 4, False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), blocks)
    head = Sequence("head", list(range(8)), SamplingParams(max_tokens=4))  # needs 2 blocks
    holders = [Sequence(f"h{i}", list(range(4)), SamplingParams(max_tokens=4)) for i in range(2)]
    for h in holders:  # KV landed here, not running yet: 2 blocks each
        assert blocks.allocate(h, 5)
        h.num_computed_tokens = 4
        h.token_ids.append(1)
    sched.add(head, front=True)  # a preempted sequence waits ahead of them
    for h in holders:
        sched.add(h)
    batch = sched.schedule()
    # the newest holder gave its blocks up; the other one's decode fits beside the head
    assert [s.request_id for s in batch.seqs] == ["head", "h0"]
    assert holders[1].block_table == [] and holders[1].num_preemptions == 1
    assert holders[1].status is SequenceStatus.WAITING


# ---- across the split --------------------------------------------------------------------------


def run(cluster: Cluster) -> None:
    """Pump until idle, with heartbeats and ticks as a process sends them each period: what
    waits at the coordinator for blocks goes once the decode worker reports them back."""
    for _ in range(1000):
        cluster.pump()
        if not cluster.coordinator.routes:
            return
        cluster.heartbeats()
        cluster.coordinator.tick(time.monotonic())
    raise AssertionError("requests still routed")


@pytest.fixture
def small_decode_cluster(tiny_dir):
    made: list[Cluster] = []

    def make(num_blocks: int = 24, **kw) -> Cluster:
        prefill = make_engine(tiny_dir, max_num_batched_tokens=64)
        decode = make_engine(tiny_dir, num_blocks=num_blocks)
        c = Cluster([prefill], [decode], **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_preempted_streams_across_the_split_equal_each_alone(small_decode_cluster, tiny_dir):
    cluster = small_decode_cluster()
    reference = make_engine(tiny_dir)
    batch = prompts(512, LENGTHS, seed=9)
    spec = m.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(batch):
        cluster.submit(f"r{i}", p, spec)
    cluster.submit("n3", batch[0], m.SamplingParams(max_tokens=30, temperature=0.8, seed=4), n=3)
    run(cluster)
    decode = cluster.workers["d0"].engine
    assert decode.status.preemptions > 0
    for i, p in enumerate(batch):
        assert cluster.tokens(f"r{i}") == {0: alone(reference, p, spec)}
    got = cluster.tokens("n3")
    assert sorted(got) == [0, 1, 2] and all(len(t) == 30 for t in got.values())
    assert set(cluster.used_blocks().values()) == {0}
    assert cluster.coordinator.routes == {}


def test_a_prompt_too_big_for_any_decode_cache_is_a_400_with_the_numbers(small_decode_cluster):
    cluster = small_decode_cluster(num_blocks=8)  # 32 tokens
    cluster.submit("big", list(range(1, 41)), m.SamplingParams(max_tokens=4))
    cluster.submit("ok", list(range(1, 11)), m.SamplingParams(max_tokens=500, ignore_eos=True))
    run(cluster)
    [error] = [e for e in cluster.bus.gateway["gw"] if isinstance(e, m.RequestError)]
    assert error.request_id == "big" and error.status == 400
    assert "the prompt (40 tokens, 1 choice(s)) needs 44 tokens of KV cache" in error.message
    assert "more than the 32 the largest decode worker holds" in error.message
    assert sum(len(t) for t in cluster.tokens("ok").values()) == 32 - 10  # the cache's length
    assert set(cluster.used_blocks().values()) == {0}
