"""Per-worker totals (issue 15 item 5): prefix-hit tokens, prefill tokens computed, KV blocks
and bytes pushed, transfer times; from the workers' heartbeats to the gateway's /metrics."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.coordinator.counter_checks import counters_problem
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.protocol import messages as m
from pdserve.protocol.control import TRANSFER_SECONDS_BUCKETS, WorkerCounters, WorkerLoad
from pdserve.worker.wire import block_bytes
from tests.cluster_util import Cluster
from tests.engine_util import make_engine, prompts

SPEC = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_two_turns_add_up_exactly(tiny_dir) -> None:
    cluster = Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir)])  # blocks of 4 tokens
    try:
        first = prompts(512, [21], seed=80)[0]
        cluster.submit("turn1", first, SPEC)
        cluster.pump()
        answer = cluster.tokens("turn1")[0]
        second = first + answer + prompts(512, [10], seed=81)[0]  # 39 tokens
        cluster.submit("turn2", second, SPEC)
        cluster.pump()
        cluster.heartbeats()
        state = cluster.coordinator.registry.cluster_state()
        counters = {w.worker_id: w.counters for w in state.workers}
    finally:
        cluster.close()
    p, d = counters["p0"], counters["d0"]
    # the prefill worker: turn 1 computed 21; turn 2 found turn 1's 5 full blocks cached
    assert (p.prefix_hit_tokens, p.prefill_tokens) == (20, 21 + 19)
    # 6 blocks for turn 1, then only blocks 8..10 (the decode worker held 7 full ones)
    assert p.kv_blocks_sent == 6 + 3
    assert p.kv_bytes_sent == 9 * block_bytes(cluster.workers["p0"].engine)
    assert sum(p.transfer_seconds_counts) == 2 and p.transfer_seconds_sum > 0
    # the decode worker computed no prompt; its cache held 28 of turn 2's tokens
    assert (d.prefix_hit_tokens, d.prefill_tokens, d.kv_blocks_sent) == (28, 0, 0)
    assert d.transfer_seconds_counts == []
    assert counters_problem(p) is None and counters_problem(d) is None


def test_gateway_renders_each_workers_totals() -> None:
    counts = [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1)
    counts[2], counts[-1] = 3, 1  # three pushes of at most 5 ms, one past 2.5 s
    c = WorkerCounters(
        prefix_hit_tokens=20,
        prefill_tokens=40,
        kv_blocks_sent=9,
        kv_bytes_sent=9 * 1024,
        kv_transfers_failed=1,
        transfer_seconds_sum=3.01,
        transfer_seconds_counts=counts,
    )
    p0 = m.WorkerStatus(
        role="prefill",
        worker_id="p0",
        model="tiny",
        load=WorkerLoad(
            free_blocks=9,
            used_blocks=1,
            total_blocks=10,
            running=0,
            waiting=0,
            queued_prompt_tokens=0,
        ),
        counters=c,
    )
    text = GatewayMetrics().render([p0])
    labels = 'role="prefill",worker="p0"'
    for line in (
        f"pdserve_worker_prefix_hit_tokens_total{{{labels}}} 20.0",
        f"pdserve_worker_prefill_tokens_total{{{labels}}} 40.0",
        f"pdserve_worker_kv_blocks_sent_total{{{labels}}} 9.0",
        f"pdserve_worker_kv_bytes_sent_total{{{labels}}} 9216.0",
        f"pdserve_worker_kv_transfers_failed_total{{{labels}}} 1.0",
        f'pdserve_worker_kv_transfer_seconds_bucket{{{labels},le="0.001"}} 0',
        f'pdserve_worker_kv_transfer_seconds_bucket{{{labels},le="0.005"}} 3',
        f'pdserve_worker_kv_transfer_seconds_bucket{{{labels},le="+Inf"}} 4',
        f"pdserve_worker_kv_transfer_seconds_count{{{labels}}} 4",
        f"pdserve_worker_kv_transfer_seconds_sum{{{labels}}} 3.01",
    ):
        assert line in text.splitlines(), line


@pytest.mark.parametrize(
    "change",
    [
        {"prefill_tokens": -1},
        {"kv_bytes_sent": 1 << 63},
        {"kv_transfers_failed": -1},
        {"transfer_seconds_sum": float("nan")},
        {"transfer_seconds_counts": [1, 2]},
    ],
)
def test_impossible_totals_are_refused(change: dict) -> None:
    assert counters_problem(dataclasses.replace(WorkerCounters(), **change)) is not None


def test_a_failed_push_is_counted(tiny_dir) -> None:
    """Every push corrupted: the decode worker refuses the KV, counts the failure and
    recomputes (the stream goes on); the prefill worker's push ended, timed, as sent."""
    engines = [make_engine(tiny_dir)], [make_engine(tiny_dir)]
    cluster = Cluster(*engines, fault=FaultPlan("corrupt"))
    try:
        for i, p in enumerate(prompts(512, [9, 14], seed=82)):
            cluster.submit(f"r{i}", p, SPEC)
        cluster.pump()
        assert all(len(cluster.tokens(f"r{i}")[0]) == 8 for i in range(2))
        cluster.heartbeats()
        state = cluster.coordinator.registry.cluster_state()
        counters = {w.worker_id: w.counters for w in state.workers}
    finally:
        cluster.close()
    # the decode worker found each push broken (the sender's side saw it sent)
    assert (counters["p0"].kv_transfers_failed, counters["d0"].kv_transfers_failed) == (0, 2)
    assert sum(counters["p0"].transfer_seconds_counts) == 2
    assert counters_problem(counters["d0"]) is None
