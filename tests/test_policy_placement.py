"""coordinator.policies, PlacementPolicy: the pick of a prefill or decode worker from its
candidates, exact, with no registry, sockets or coordinator."""

from __future__ import annotations

import pytest

from pdserve.coordinator.policies import (
    DECODE_HOT_SPOT_STREAMS,
    ROUTING_MODES,
    Candidate,
    DecodePick,
    DecodeReason,
    PlacementPolicy,
    PrefillPick,
    PrefillReason,
    RoutingMode,
)

KV = PlacementPolicy(RoutingMode.KV, hot_spot_tokens=100)
LOAD = PlacementPolicy(RoutingMode.LOAD)
TURN = PlacementPolicy(RoutingMode.ROUND_ROBIN)


def prefill(wid: str, hit: int = 0, queued: int = 0) -> Candidate:
    return Candidate(wid, hit_blocks=hit, queued_tokens=queued)


def decode(wid: str, free: int, running: int = 0, hit: int = 0) -> Candidate:
    return Candidate(wid, hit_blocks=hit, free_blocks=free, running=running)


def test_routing_modes_parse_from_the_cli_names() -> None:
    assert ROUTING_MODES == ("kv", "load", "round-robin")
    assert [RoutingMode.parse(name) for name in ROUTING_MODES] == list(RoutingMode)
    assert RoutingMode.parse(RoutingMode.LOAD) is RoutingMode.LOAD
    with pytest.raises(ValueError, match="routing must be one of kv, load, round-robin, got 'x'"):
        RoutingMode.parse("x")
    with pytest.raises(ValueError, match=">= 0 tokens"):
        PlacementPolicy(RoutingMode.KV, hot_spot_tokens=-1)


def test_kv_prefill_takes_the_fewest_tokens_to_compute_plus_queue() -> None:
    # 100 tokens, blocks of 16: p1 holds 4 blocks (36 to compute) but 65 queued: 101 > 100
    pool = [prefill("p0"), prefill("p1", hit=4, queued=65)]
    assert KV.prefill(100, 16, pool) == PrefillPick("p0", PrefillReason.KV_MISS, 100)
    pool = [prefill("p0", queued=0), prefill("p1", hit=4, queued=40)]  # 76 < 100
    assert KV.prefill(100, 16, pool) == PrefillPick("p1", PrefillReason.KV_HIT, 36)


def test_kv_prefill_breaks_a_tie_by_the_shorter_queue() -> None:
    pool = [prefill("p0", hit=1, queued=16), prefill("p1", hit=0, queued=0)]  # 100 each
    assert KV.prefill(100, 16, pool) == PrefillPick("p1", PrefillReason.KV_MISS, 100)
    pool = [prefill("p0", queued=5), prefill("p1", queued=5)]  # a full tie: the first
    assert KV.prefill(10, 16, pool).worker_id == "p0"


def test_the_hot_spot_guard_sends_a_hot_prefix_to_the_shortest_queue() -> None:
    # p0 holds 10 of 13 blocks: 40 to compute + 101 queued beats 200 on p1, but its queue is
    # more than 100 tokens longer than p1's
    pool = [prefill("p0", hit=10, queued=101), prefill("p1", queued=0)]
    assert KV.prefill(200, 16, pool) == PrefillPick("p1", PrefillReason.HOT_SPOT_GUARD, 200)
    pool = [prefill("p0", hit=10, queued=100), prefill("p1", queued=0)]  # not more than 100
    assert KV.prefill(200, 16, pool) == PrefillPick("p0", PrefillReason.KV_HIT, 40)
    off = PlacementPolicy(RoutingMode.KV, hot_spot_tokens=0)
    pool = [prefill("p0", hit=10, queued=150), prefill("p1", queued=0)]
    assert off.prefill(200, 16, pool) == PrefillPick("p0", PrefillReason.KV_HIT, 40)


def test_load_prefill_takes_the_shortest_queue_blind_to_caches() -> None:
    pool = [prefill("p0", hit=6, queued=30), prefill("p1", queued=20)]
    assert LOAD.prefill(108, 16, pool) == PrefillPick("p1", PrefillReason.LOAD, 108)


def test_round_robin_goes_in_id_order_and_wraps() -> None:
    pool = [prefill("p2"), prefill("p0"), prefill("p1")]
    picks = []
    last = None
    for _ in range(4):
        pick = TURN.prefill(8, 16, pool, last)
        assert pick.reason is PrefillReason.ROUND_ROBIN and pick.compute == 8
        picks.append(last := pick.worker_id)
    assert picks == ["p0", "p1", "p2", "p0"]
    # a worker gone from the pool is skipped; the last one picked need not be in it
    assert TURN.prefill(8, 16, [prefill("p0"), prefill("p2")], "p1").worker_id == "p2"
    dpool = [decode("d1", 8), decode("d0", 8)]
    assert TURN.decode(4, dpool, "d1") == DecodePick("d0", None)


def test_decode_by_load_wants_free_blocks_then_fewer_streams() -> None:
    pool = [decode("d0", free=10, running=1), decode("d1", free=12, running=5)]
    assert LOAD.decode(4, pool) == DecodePick("d1", None)
    pool = [decode("d0", free=12, running=6), decode("d1", free=12, running=5)]
    assert LOAD.decode(4, pool) == DecodePick("d1", None)
    # kv with no cache known places by load too, and gives no reason
    pool = [decode("d0", free=10, hit=3), decode("d1", free=12)]
    assert KV.decode(4, pool, cache_known=False) == DecodePick("d1", None)


def test_decode_by_cache_moves_the_fewest_blocks() -> None:
    pool = [decode("d0", free=10, hit=3), decode("d1", free=12)]
    assert KV.decode(4, pool, cache_known=True) == DecodePick("d0", DecodeReason.KV_HIT)
    pool = [decode("d0", free=10), decode("d1", free=12)]
    assert KV.decode(4, pool, cache_known=True) == DecodePick("d1", DecodeReason.KV_MISS)


def test_the_decode_guard_spreads_a_busy_holder() -> None:
    busy = DECODE_HOT_SPOT_STREAMS + 1
    pool = [decode("d0", free=10, running=busy, hit=3), decode("d1", free=12, running=0)]
    assert KV.decode(4, pool, cache_known=True) == DecodePick("d1", DecodeReason.HOT_SPOT_GUARD)
    pool = [decode("d0", free=10, running=busy - 1, hit=3), decode("d1", free=12, running=0)]
    assert KV.decode(4, pool, cache_known=True) == DecodePick("d0", DecodeReason.KV_HIT)
