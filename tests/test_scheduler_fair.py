"""The engine scheduler admits waiting sequences in the fair queue's order (tier, tenants'
weighted token shares, priority and arrival), a preempted sequence first; stepped with no
model: what the engine would compute is played by hand."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.scheduler import Scheduler, Sequence, SequenceStatus
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tenancy import Share, Tier

PARAMS = SamplingParams(max_tokens=4)


def share(tenant: str, weight: float = 1, tier: Tier = Tier.STANDARD, priority: int = 0) -> Share:
    return Share(tenant=tenant, tier=tier, weight=weight, priority=priority)


def seq(name: str, s: Share, tokens: int = 8) -> Sequence:
    return Sequence(name, list(range(tokens)), PARAMS, share=s)


def admit_one_at_a_time(sched: Scheduler) -> list[str]:
    """Each step admits one sequence (``max_num_seqs=1``), which then finishes."""
    order = []
    while sched.waiting:
        batch = sched.schedule()
        [admitted] = batch.seqs
        order.append(str(admitted.request_id))
        sched.finish(admitted)
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    return order


def test_two_tenants_waiting_are_admitted_in_fair_order_not_fifo() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=1), BlockManager(64, 4, False))
    for i in range(1, 5):  # A's backlog came first
        sched.add(seq(f"a{i}", share("A")))
    sched.add(seq("b1", share("B")))
    sched.add(seq("b2", share("B")))
    sched.add(seq("c1", share("C", weight=3), tokens=24))  # three times A's cost, thrice the weight
    assert admit_one_at_a_time(sched) == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]


def test_a_higher_tier_and_a_lower_priority_value_go_first() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=1), BlockManager(64, 4, False))
    sched.add(seq("batch", share("A", tier=Tier.BATCH)))
    sched.add(seq("late", share("B", priority=1)))
    sched.add(seq("urgent", share("B", priority=-1)))
    sched.add(seq("premium", share("C", tier=Tier.PREMIUM)))
    assert admit_one_at_a_time(sched) == ["premium", "urgent", "late", "batch"]


def test_a_preempted_sequence_is_admitted_again_first() -> None:
    # 4 blocks of 4 tokens: x and y (8 tokens each) fill them; x's next token needs a fifth
    blocks = BlockManager(4, 4, False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), blocks)
    x, y = seq("x", share("A")), seq("y", share("B", tier=Tier.BATCH))
    sched.add(x)
    sched.add(y)
    first = sched.schedule()
    assert [s.request_id for s in first.seqs] == ["x", "y"] and blocks.num_free_blocks == 0
    for s, n in zip(first.seqs, first.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        s.token_ids.append(100)  # token 0 sampled
    sched.add(seq("p", share("P", tier=Tier.PREMIUM), tokens=4))
    second = sched.schedule()
    assert [s.request_id for s in second.preempted] == ["y"]  # the newest, for x's block
    assert [s.request_id for s in second.seqs] == ["x"] and y.status is SequenceStatus.WAITING
    assert sched.waiting.peek() is y and len(sched.waiting) == 2
    sched.finish(x)
    third = sched.schedule()  # y (a batch tenant's) before the premium one that waited
    assert [s.request_id for s in third.seqs] == ["y", "p"]
    for s in third.seqs:
        sched.finish(s)
    assert blocks.num_free_blocks == 4 and not sched.waiting and not sched.running
