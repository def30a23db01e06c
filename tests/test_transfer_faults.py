"""Injected KV transfer faults: ``recompute`` finishes every request exactly, ``fail`` ends it
with an error; both sides free every block either way."""

from __future__ import annotations

import pytest

from pdserve.kvtransfer.faults import FaultPlan
from pdserve.protocol import messages as m
from tests.cluster_util import Cluster
from tests.engine_util import hf_greedy, make_engine, prompts

SPEC = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FAULTS = {
    "drop": FaultPlan("drop"),
    "delay": FaultPlan("delay", delay_s=2.0),  # past the 0.5 s transfer timeout
    "truncate": FaultPlan("truncate"),
    "corrupt": FaultPlan("corrupt"),
}


def run(
    tiny_dir, fault: FaultPlan, policy: str, backend: str = "zmq"
) -> tuple[Cluster, list[list[int]]]:
    cluster = Cluster(
        [make_engine(tiny_dir)],
        [make_engine(tiny_dir)],
        backend=backend,
        fault=fault,
        policy=policy,
        transfer_timeout_s=0.5,
    )
    batch = prompts(512, [5, 23], seed=30)
    for i, p in enumerate(batch):
        cluster.submit(f"r{i}", p, SPEC)
    cluster.pump()
    return cluster, batch


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
@pytest.mark.parametrize("mode", sorted(FAULTS))
def test_recompute_policy_finishes_exactly(tiny_dir, mode: str, backend: str) -> None:
    cluster, batch = run(tiny_dir, FAULTS[mode], "recompute", backend)
    try:
        for i, p in enumerate(batch):
            assert cluster.tokens(f"r{i}") == {0: hf_greedy(tiny_dir, p, 8)}
        assert cluster.errors() == []
        assert set(cluster.used_blocks().values()) == {0}
        assert cluster.coordinator.routes == {}
    finally:
        cluster.close()


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
@pytest.mark.parametrize("mode", sorted(FAULTS))
def test_fail_policy_ends_with_an_error(tiny_dir, mode: str, backend: str) -> None:
    cluster, _ = run(tiny_dir, FAULTS[mode], "fail", backend)
    try:
        assert {e.request_id for e in cluster.errors()} == {"r0", "r1"}
        assert all(e.status == 500 and "KV transfer failed" in e.message for e in cluster.errors())
        assert set(cluster.used_blocks().values()) == {0}
        assert cluster.coordinator.routes == {}
    finally:
        cluster.close()


def test_fault_plan_parsing() -> None:
    assert FaultPlan.parse("drop:0.25") == FaultPlan("drop", 0.25)
    assert FaultPlan.parse("delay:1:45") == FaultPlan("delay", 1.0, 45.0)
    with pytest.raises(ValueError, match="unknown KV fault"):
        FaultPlan.parse("explode")
