"""What workers publish of their prefix cache (``KVEvents``) and the coordinator's index of it:
exact hashes stored, evicted and snapshotted, restarts and gaps, and the bounds on what a worker
may claim."""

from __future__ import annotations

import time

import pytest

from pdserve.coordinator.kv_index import KVIndex, kv_events_problem
from pdserve.coordinator.registry import WorkerRegistry
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_events import KVEventPublisher
from pdserve.protocol.control import KVEvents, KVLayout, Register
from pdserve.protocol.prefix import MAX_KV_EVENT_HASHES, block_hashes, cacheable_hashes
from tests.test_block_manager import Seq, run

A = list(range(100, 112))  # 3 blocks of 4
B = list(range(200, 212))


def hashes(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, 4, [])


def test_publisher_sends_a_snapshot_then_exact_stores_and_evictions() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    pub = KVEventPublisher(bm, "p0", snapshot_every=4)
    (first,) = pub.messages()  # the first period: a snapshot, empty here
    assert (first.snapshot, first.stored, first.part, first.parts, first.seq) == (
        True,
        [],
        0,
        1,
        0,
    )
    a = Seq(A)
    run(bm, a)
    (delta,) = pub.messages()
    assert (delta.snapshot, delta.stored, delta.evicted, delta.seq) == (False, hashes(A), [], 1)
    bm.free_seq(a)
    assert pub.messages() == []  # freed blocks stay cached: nothing changed
    # B takes the never-hashed block, then evicts A's blocks, its tail first
    ha, hb = hashes(A), hashes(B)
    run(bm, Seq(B))
    (delta,) = pub.messages()
    assert (delta.stored, delta.evicted, delta.seq) == (hb, [ha[2], ha[1]], 2)
    (snap,) = pub.messages()  # the fourth period since the last snapshot
    assert snap.snapshot and snap.stored == [ha[0], *hb] and snap.seq == 3


def test_a_hash_stored_then_evicted_in_one_period_goes_out_once_as_evicted() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    pub = KVEventPublisher(bm, "p0")
    pub.messages()
    a = Seq(A)
    run(bm, a)
    bm.free_seq(a)
    run(bm, Seq(B))  # evicts all of A's blocks in the same period
    msgs = pub.messages()
    stored = [h for msg in msgs for h in msg.stored]
    evicted = [h for msg in msgs for h in msg.evicted]
    assert sorted(stored) == sorted(hashes(B)) and sorted(evicted) == sorted(hashes(A))


def test_deltas_and_snapshots_split_into_bounded_parts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    pub = KVEventPublisher(bm, "p0", snapshot_every=2, max_hashes=3)
    pub.messages()
    run(bm, Seq(list(range(28))))  # 7 full blocks
    deltas = pub.messages()
    assert [len(d.stored) for d in deltas] == [3, 3, 1] and not any(d.snapshot for d in deltas)
    parts = pub.messages()
    assert [(p.part, p.parts, len(p.stored)) for p in parts] == [(0, 3, 3), (1, 3, 3), (2, 3, 1)]
    assert [p.seq for p in [*deltas, *parts]] == [1, 2, 3, 4, 5, 6]
    index = KVIndex()
    for msg in [*deltas, *parts]:
        assert index.apply(msg, 8) is None
    assert index.held["p0"] == set(bm.cached)


def test_a_change_log_past_its_bound_becomes_a_snapshot() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    pub = KVEventPublisher(bm, "p0", max_hashes=2)  # log bound: max(4 blocks, 2)
    pub.messages()
    for i in range(3):  # 12 hashes stored, 8 of them evicted again
        seq = Seq(list(range(1000 * i, 1000 * i + 16)))
        run(bm, seq)
        bm.free_seq(seq)
    parts = pub.messages()
    assert all(p.snapshot for p in parts) and {h for p in parts for h in p.stored} == set(bm.cached)


def events(seq: int, stored=(), evicted=(), epoch="e1", **kw) -> KVEvents:
    return KVEvents(
        worker_id="p0", epoch=epoch, seq=seq, stored=list(stored), evicted=list(evicted), **kw
    )


def test_index_prefix_runs_stop_at_the_first_missing_block() -> None:
    index = KVIndex()
    ha, hb = hashes(A), hashes(B)
    index.apply(events(0, [ha[0], ha[1], ha[2]]), 64)
    index.apply(KVEvents(worker_id="p1", epoch="x", seq=0, stored=[ha[0], ha[2], hb[0]]), 64)
    assert index.prefix_blocks(ha, ["p0", "p1", "p2"]) == {"p0": 3, "p1": 1, "p2": 0}
    assert index.prefix_blocks(hb, ["p0", "p1"]) == {"p0": 0, "p1": 1}
    index.apply(events(1, evicted=[ha[1]]), 64)
    assert index.prefix_blocks(ha, ["p0"]) == {"p0": 1}
    assert index.holders[ha[2]] == {"p0", "p1"} and ha[1] not in index.holders
    # the coordinator hashes a prompt as the engine does, all but the last token's blocks
    assert cacheable_hashes([*A, 7], 4) == ha and cacheable_hashes(A, 4) == ha[:2]


def test_index_new_epoch_gap_and_snapshot() -> None:
    index = KVIndex()
    ha, hb = hashes(A), hashes(B)
    index.apply(events(0, ha), 64)
    index.apply(events(2, hb[:1]), 64)  # seq 1 was lost: counted, applied all the same
    assert index.gaps == 1 and index.held["p0"] == {*ha, hb[0]}
    snap = [
        events(3, ha[:1], snapshot=True, part=0, parts=2),
        events(4, hb[1:], snapshot=True, part=1, parts=2),
    ]
    for msg in snap:
        index.apply(msg, 64)
    assert index.held["p0"] == {ha[0], *hb[1:]}  # the snapshot replaced everything
    # a snapshot missing a part changes nothing
    index.apply(events(5, hb, snapshot=True, part=0, parts=2), 64)
    index.apply(events(7, ha, snapshot=True, part=1, parts=2), 64)
    assert index.held["p0"] == {ha[0], *hb[1:]}
    # a restarted process (new epoch): what the old one held is gone
    index.apply(events(0, hb[:1], epoch="e2"), 64)
    assert index.held["p0"] == {hb[0]} and set(index.holders) == {hb[0]}
    index.drop("p0")
    assert index.holders == {} and index.held == {}


def test_index_never_believes_more_blocks_than_registered() -> None:
    index = KVIndex()
    ha, hb = hashes(A), hashes(B)
    assert index.apply(events(0, ha), 4) is None
    assert "the 4 blocks it registered" in index.apply(events(1, hb), 4)
    assert index.holders == {} and "p0" not in index.held
    assert "the 4 blocks it registered" in index.apply(events(2, [*ha, *hb], snapshot=True), 4)
    assert index.holders == {}


@pytest.mark.parametrize(
    "msg, problem",
    [
        (events(0, range(MAX_KV_EVENT_HASHES + 1)), "at most"),
        (events(0, [2**64]), "outside"),
        (events(0, [-1]), "outside"),
        (events(0, epoch=""), "epoch"),
        (events(-1), "seq"),
        (events(0, evicted=[1], snapshot=True), "snapshot"),
        (events(0, snapshot=True, part=2, parts=2), "snapshot"),
        (events(0, snapshot=True, part=0, parts=3), "at most 2"),  # 8192 blocks: 2 parts
        (events(0, part=1, parts=2), "outside a snapshot"),
    ],
)
def test_malformed_kv_events_are_refused(msg: KVEvents, problem: str) -> None:
    assert problem in kv_events_problem(msg, 2 * MAX_KV_EVENT_HASHES)


def test_registry_takes_events_only_from_the_registered_worker() -> None:
    reg = WorkerRegistry()
    layout = KVLayout(block_size=4, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)
    info = Register(
        role="prefill",
        worker_id="p0",
        model="tiny",
        control_address="inproc://p0",
        transfer_address="",
        transfer_backend="zmq",
        layout=layout,
        num_blocks=64,
    )
    assert reg.admit(info, "key-a")
    reg.register(info, time.monotonic())
    ha = hashes(A)
    assert not reg.admit(events(0, ha), "key-b")  # an impostor
    assert not reg.admit(events(0, [2**64]), "key-a")
    assert reg.admit(events(0, ha), "key-a")
    reg.kv_events(events(0, ha))
    assert reg.kv.held["p0"] == set(ha)
    reg.kv_events(
        KVEvents(worker_id="p9", epoch="e", seq=0, stored=ha)
    )  # never registered: ignored
    assert "p9" not in reg.kv.held
    reg.register(info, time.monotonic())  # the keep-alive: nothing forgotten
    assert reg.kv.held["p0"] == set(ha)
    reg.expire(time.monotonic() + 60)  # dead: forgotten
    assert reg.kv.holders == {}
