"""The coordinator's queue of choices waiting for decode blocks, stepped with a clock and no
workers: choices are placed in tier, fair-share and priority order (not first come, first
served), a full queue refuses its lowest tier first, and each request's ``Share`` goes on to
its workers in ``Reserve`` and ``PrefillJob``."""

from __future__ import annotations

from pdserve.coordinator.coordinator import Coordinator
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, WorkerLoad
from pdserve.protocol.tenancy import Share, Tier
from tests import test_coordinator_waits as waits
from tests.test_coordinator_waits import Outbox, register, reserved


def share(tenant: str, tier: Tier = Tier.STANDARD, priority: int = 0) -> Share:
    return Share(tenant=tenant, tier=tier, weight=1, priority=priority)


def cluster(decode_blocks: int = 4, **options: object) -> tuple[Coordinator, Outbox]:
    """One decode worker of ``decode_blocks`` blocks of 16 tokens, one prefill worker."""
    out = Outbox()
    c = Coordinator(out, heartbeat_timeout_s=1e9, **options)  # type: ignore[arg-type]
    for role, wid, blocks in (("decode", "d0", decode_blocks), ("prefill", "p0", 64)):
        register(c, role, wid, blocks)
    return c, out


def generate(c: Coordinator, rid: str, s: Share | None, prompt_len: int = 40) -> None:
    waits.generate(c, rid, prompt_len, share=s)


def test_queued_choices_are_placed_by_tier_then_fair_share_then_arrival() -> None:
    c, out = cluster()  # 4 blocks: one 40-token prompt (3 blocks) at a time
    generate(c, "first", None)
    assert [msg.request_id for _, msg in out.take(m.Reserve)] == ["first"]
    arrivals = [
        ("a1", share("A")),
        ("a2", share("A")),
        ("a3", share("A")),
        ("b1", share("B")),
        ("z1", share("Z", tier=Tier.BATCH)),
        ("b2", share("B")),
        ("d1", None),  # no share: the default tenant, standard
        ("p1", share("P", tier=Tier.PREMIUM)),
    ]
    for rid, s in arrivals:
        generate(c, rid, s)
    assert out.take(m.Reserve) == [] and len(c.routes.queued) == len(arrivals)
    placed = []
    for t in range(1, len(arrivals) + 2):  # blocks come back for one prompt at a time
        c.handle(Heartbeat(worker_id="d0", load=WorkerLoad.idle(4)), float(t))
        placed += [msg.request_id for _, msg in out.take(m.Reserve)]
    # first come, first served would be a1 a2 a3 b1 z1 b2 d1 p1
    assert placed == ["p1", "a1", "b1", "d1", "a2", "b2", "a3", "z1"]
    assert not c.routes.queued


def test_a_flooding_tenant_does_not_starve_a_steady_one() -> None:
    c, out = cluster()
    generate(c, "first", None)
    out.take(m.Reserve)
    for i in range(20):
        generate(c, f"flood{i}", share("F"))
    placed = []
    for t in range(1, 7):
        generate(c, f"steady{t}", share("S"))  # one at a time, behind the whole flood
        c.handle(Heartbeat(worker_id="d0", load=WorkerLoad.idle(4)), float(t))
        placed += [msg.request_id for _, msg in out.take(m.Reserve)]
    assert placed == ["flood0", "steady1", "flood1", "steady2", "flood2", "steady3"]


def test_a_full_queue_refuses_its_lowest_tier_first() -> None:
    c, out = cluster(max_queued=2)
    generate(c, "first", None)
    for rid, s in [
        ("z1", share("Z", tier=Tier.BATCH)),
        ("z2", share("Z", tier=Tier.BATCH)),
        ("s1", share("S")),  # the newest batch one (z2) makes room
        ("s2", share("S")),  # then z1
        ("s3", share("S")),  # nothing lower to refuse: s3 is
        ("z3", share("Z", tier=Tier.BATCH)),
        ("p1", share("P", tier=Tier.PREMIUM)),  # s2, the newest standard one, makes room
    ]:
        generate(c, rid, s)
    refused = [(e.request_id, e.status) for e in out.gateway if isinstance(e, m.RequestError)]
    assert refused == [("z2", 503), ("z1", 503), ("s3", 503), ("z3", 503), ("s2", 503)]
    assert "a higher tier's request came" in out.gateway[0].message
    assert {r.request.request_id for r in c.routes.queued} == {"s1", "p1"}
    assert sorted(k.request_id for k in c.routes) == ["first", "p1", "s1"]
    assert out.take(m.Abort) == []  # a queued choice holds nothing on any worker


def test_the_share_goes_on_to_the_workers() -> None:
    s = share("acme", tier=Tier.PREMIUM, priority=-3)
    c, out = cluster(decode_blocks=64)
    generate(c, "r", s)
    [(_, reserve)] = out.take(m.Reserve)
    assert reserve.share == s
    c.handle(reserved("d0", "r"), 0.1)
    [(_, job)] = out.take(m.PrefillJob)
    assert job.share == s
    # a short prompt prefilled by its decode worker itself (conditional disaggregation)
    c, out = cluster(decode_blocks=64, max_local_prefill_tokens=64)
    generate(c, "short", s, prompt_len=8)
    [(wid, local)] = out.take(m.PrefillJob)
    assert (wid, local.dst_block_ids, local.share) == ("d0", [], s)
    generate(c, "none", None, prompt_len=8)
    [(_, local)] = out.take(m.PrefillJob)
    assert local.share is None  # the workers read it as protocol.tenancy.DEFAULT
