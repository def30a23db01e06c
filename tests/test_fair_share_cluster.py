"""A tenant's share, through the real coordinator and workers in one process (tests/
cluster_util.py): a flooding tenant's backlog on the prefill worker does not starve a steady
tenant's requests, and a premium request jumps both; every block is free at the end."""

from __future__ import annotations

import pytest

from pdserve.protocol import messages as m
from pdserve.protocol.tenancy import Share, Tier
from tests.cluster_util import Cluster
from tests.engine_util import make_engine, prompts

SPEC = m.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cluster(tiny_dir):
    # the prefill engine computes one prompt at a time: its waiting queue decides the order
    engine_p = make_engine(tiny_dir, max_num_seqs=1, max_num_batched_tokens=32)
    c = Cluster([engine_p], [make_engine(tiny_dir)])
    yield c
    c.close()


def submit(cluster: Cluster, rid: str, prompt: list[int], share: Share | None) -> None:
    req = m.Generate(
        request_id=rid,
        model="tiny",
        prompt_token_ids=prompt,
        sampling=SPEC,
        n=1,
        stream_address="gw",
        share=share,
    )
    cluster.bus.queue.append(("coordinator", req))


def test_a_flood_does_not_starve_a_steady_tenant(cluster) -> None:
    flood = Share(tenant="flood", tier=Tier.STANDARD, weight=1)
    steady = Share(tenant="steady", tier=Tier.STANDARD, weight=1)
    premium = Share(tenant="vip", tier=Tier.PREMIUM, weight=1)
    batch = prompts(512, [8] * 16, seed=7)  # equal lengths: equal costs
    for i in range(12):
        submit(cluster, f"f{i}", batch[i], flood)
    for i in range(3):
        submit(cluster, f"s{i}", batch[12 + i], steady)
    submit(cluster, "vip", batch[15], premium)
    cluster.pump()
    # the order token 0s reached the gateway: the prefill worker's admission order
    firsts = [c.request_id for c in cluster.chunks() if c.index == 0]
    # first come, first served would be f0..f11 s0 s1 s2 vip
    assert firsts == [
        "vip",
        "f0",
        "s0",
        "f1",
        "s1",
        "f2",
        "s2",
        *[f"f{i}" for i in range(3, 12)],
    ]
    for rid in firsts:
        assert len(cluster.tokens(rid)[0]) == 3
    assert cluster.errors() == []
    assert set(cluster.used_blocks().values()) == {0}
    assert cluster.coordinator.routes == {}
