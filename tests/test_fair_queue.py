"""The fair queue (pdserve/fair_queue.py): the exact order of service for given arrivals.
Tiers strictly, tenants by weighted fair shares of tokens, a tenant's own items by
(priority, arrival); put-back items first; removal and refusal order."""

from __future__ import annotations

import pytest

from pdserve.fair_queue import FairQueue
from pdserve.protocol.tenancy import Share, Tier


def share(tenant: str, weight: float = 1, tier: Tier = Tier.STANDARD, priority: int = 0) -> Share:
    return Share(tenant=tenant, tier=tier, weight=weight, priority=priority)


def push(q: FairQueue[str], names: list[str], s: Share, cost: int = 10) -> None:
    for name in names:
        q.push(name, s, cost)


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while q:
        assert q.peek() == q.peek()  # peeking changes nothing
        nxt = q.peek()
        assert q.pop() == nxt
        out.append(nxt)
    return out


def test_two_tenants_of_equal_weight_share_tokens_not_requests() -> None:
    q: FairQueue[str] = FairQueue()
    push(q, ["a1", "a2", "a3"], share("A"), cost=30)
    push(q, [f"b{i}" for i in range(1, 7)], share("B"), cost=10)
    # each 30-token item of A is worth three of B's 10-token ones; ties go to the earlier item
    assert drain(q) == ["a1", "b1", "b2", "b3", "a2", "b4", "b5", "b6", "a3"]


def test_weights_three_to_one_with_equal_costs() -> None:
    q: FairQueue[str] = FairQueue()
    push(q, [f"a{i}" for i in range(1, 9)], share("A", weight=3))
    push(q, ["b1", "b2", "b3"], share("B", weight=1))
    assert drain(q) == ["a1", "b1", "a2", "a3", "a4", "b2", "a5", "a6", "a7", "b3", "a8"]


def test_weights_three_to_one_with_different_costs() -> None:
    q: FairQueue[str] = FairQueue()
    push(q, [f"a{i}" for i in range(1, 7)], share("A", weight=3), cost=20)
    push(q, ["b1", "b2", "b3", "b4"], share("B", weight=1), cost=10)
    # by a4, b3 (both start at virtual time 20): A had 60 tokens, B 20
    assert drain(q) == ["a1", "b1", "a2", "b2", "a3", "a4", "b3", "a5", "b4", "a6"]


def test_a_higher_tier_is_always_taken_first() -> None:
    q: FairQueue[str] = FairQueue()
    push(q, ["batch1", "batch2"], share("A", weight=1000, tier=Tier.BATCH), cost=1)
    push(q, ["std1", "std2"], share("B", weight=0.001), cost=10_000)
    assert q.pop() == "std1"  # a standard item, however heavy, before any batch one
    push(q, ["prem1"], share("C", tier=Tier.PREMIUM))
    assert drain(q) == ["prem1", "std2", "batch1", "batch2"]


def test_priority_orders_a_tenants_own_items_not_its_share() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a1", share("A", priority=0), 10)
    q.push("a2", share("A", priority=5), 10)
    q.push("a3", share("A", priority=-1), 10)
    q.push("a4", share("A", priority=0), 10)
    q.push("b1", share("B", priority=-100), 10)
    q.push("b2", share("B", priority=-100), 10)
    # within A: lower first, ties by arrival; B's low values do not take A's share
    assert drain(q) == ["a3", "b1", "a1", "b2", "a4", "a2"]


def test_a_newcomer_is_not_starved_by_a_long_backlog() -> None:
    q: FairQueue[str] = FairQueue()
    push(q, [f"a{i}" for i in range(1, 101)], share("A"))
    assert [q.pop() for _ in range(50)] == [f"a{i}" for i in range(1, 51)]
    push(q, ["c1", "c2", "c3"], share("C"))
    assert [q.pop() for _ in range(6)] == ["c1", "a51", "c2", "a52", "c3", "a53"]
    assert len(q) == 47


def test_an_idle_tenant_banks_no_time() -> None:
    q: FairQueue[str] = FairQueue()
    push(q, [f"a{i}" for i in range(1, 11)], share("A"))
    push(q, ["b1"], share("B"))
    assert [q.pop() for _ in range(4)] == ["a1", "b1", "a2", "a3"]
    push(q, ["b2", "b3", "b4"], share("B"))  # back after a while: shares from now, no catch-up
    assert [q.pop() for _ in range(6)] == ["b2", "a4", "b3", "a5", "b4", "a6"]


def test_removal_is_uncharged_and_by_identity() -> None:
    q: FairQueue[list[int]] = FairQueue()
    a1, a2, b1, b2 = [1], [1], [2], [2]  # equal lists, different items
    q.push(a1, share("A"), 100)
    q.push(a2, share("A"), 10)
    q.push(b1, share("B"), 10)
    q.push(b2, share("B"), 10)
    assert a2 in q and [1] not in q
    assert q.remove(a1) and not q.remove(a1) and not q.remove([1])
    assert len(q) == 3
    # a1 was never served: A's start stays 0, so a2 (earlier than b1) comes first
    order = [q.pop() for _ in range(3)]
    assert [x is y for x, y in zip(order, (a2, b1, b2), strict=True)] == [True] * 3
    with pytest.raises(IndexError):
        q.peek()
    with pytest.raises(IndexError):
        q.pop()


def test_a_tier_that_empties_forgets_its_tags() -> None:
    q: FairQueue[str] = FairQueue()
    push(q, ["a1", "a2", "a3"], share("A"))
    assert drain(q) == ["a1", "a2", "a3"]
    push(q, ["a4"], share("A"))
    push(q, ["b1"], share("B"))
    assert drain(q) == ["a4", "b1"]  # a new busy period: A owes nothing


def test_put_back_items_come_out_first_last_one_first_uncharged() -> None:
    q: FairQueue[str] = FairQueue()
    push(q, ["a1", "a2"], share("A"))
    push(q, ["b1", "b2"], share("B"))
    push(q, ["p1"], share("P", tier=Tier.PREMIUM))
    assert q.pop() == "p1"
    q.push_front("p1")  # preempted: ahead of everything again
    q.push_front("x")
    q.push_front("y")
    assert list(q)[:3] == ["y", "x", "p1"]
    assert q.remove("x")
    assert drain(q) == ["y", "p1", "a1", "b1", "a2", "b2"]


def test_the_newest_of_the_lowest_tier_is_refused_first() -> None:
    q: FairQueue[str] = FairQueue()
    assert q.newest_below(Tier.PREMIUM) is None
    push(q, ["s1"], share("S"))
    push(q, ["b1", "b2"], share("B", tier=Tier.BATCH))
    push(q, ["c1"], share("C", tier=Tier.BATCH))
    q.push_front("back")  # never refused: it was running
    assert q.newest_below(Tier.PREMIUM) == "c1"
    assert q.newest_below(Tier.STANDARD) == "c1"
    assert q.newest_below(Tier.BATCH) is None
    for x in ("b1", "b2", "c1"):
        q.remove(x)
    assert q.newest_below(Tier.STANDARD) is None
    assert q.newest_below(Tier.PREMIUM) == "s1"


def test_an_item_waits_once_and_costs_at_least_one() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a0", share("A"), 0)  # costs 1, not 0: a stream of empty items cannot hog a tier
    q.push("a1", share("A"), 0)
    q.push("b0", share("B"), 1)
    with pytest.raises(ValueError, match="queued already"):
        q.push("a0", share("A"), 1)
    with pytest.raises(ValueError, match="queued already"):
        q.push_front("b0")
    assert drain(q) == ["a0", "b0", "a1"]
    assert not q and len(q) == 0 and list(q) == []
