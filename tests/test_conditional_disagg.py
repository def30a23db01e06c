"""Conditional disaggregation: short prompts, or any prompt while the prefill pool is backed
up, are prefilled by the decode worker itself (no KV transfer), token for token the same."""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.protocol import messages as m
from pdserve.worker.wire import heartbeat
from tests.cluster_util import Cluster
from tests.e2e_util import ServedCluster
from tests.engine_util import hf_greedy, make_engine, prompts
from tests.gateway_util import wait_until

SPEC = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make(tiny_dir, **options) -> Cluster:
    return Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir)], **options)


def prefill_jobs(cluster: Cluster) -> list[str]:
    """Run the cluster until idle; which workers were sent a PrefillJob, in order."""
    sent: list[str] = []
    handles = {wid: w.handle for wid, w in cluster.workers.items()}

    def recording(wid: str):
        def handle(msg: m.Message) -> None:
            if isinstance(msg, m.PrefillJob):
                sent.append(wid)
            handles[wid](msg)

        return handle

    for wid, w in cluster.workers.items():
        w.handle = recording(wid)
    try:
        cluster.pump()
    finally:
        for wid, w in cluster.workers.items():
            w.handle = handles[wid]
    return sent


def test_short_prompts_are_prefilled_on_the_decode_worker(tiny_dir) -> None:
    cluster = make(tiny_dir, max_local_prefill_tokens=16)
    try:
        short, long = prompts(512, [16, 17], seed=50)
        cluster.submit("short", short, SPEC)
        cluster.submit("long", long, SPEC)
        assert sorted(prefill_jobs(cluster)) == ["d0", "p0"]
        assert cluster.tokens("short") == {0: hf_greedy(tiny_dir, short, 8)}
        assert cluster.tokens("long") == {0: hf_greedy(tiny_dir, long, 8)}
        assert cluster.coordinator.decisions == {"local_short_prompt": 1, "disaggregated": 1}
        assert set(cluster.used_blocks().values()) == {0}
        assert cluster.coordinator.routes == {}
    finally:
        cluster.close()


def test_a_backed_up_prefill_pool_sends_prompts_to_decode(tiny_dir) -> None:
    cluster = make(tiny_dir, max_prefill_queue_tokens=100)
    try:
        prompt = prompts(512, [30], seed=51)[0]
        cluster.submit("calm", prompt, SPEC)
        assert prefill_jobs(cluster) == ["p0"]
        # the prefill worker reports a long queue: the next prompt stays on the decode side
        busy = heartbeat(cluster.workers["p0"].engine, "p0", queued_prompt_tokens=500)
        cluster.coordinator.handle(busy, time.monotonic())
        cluster.submit("busy", prompt, SPEC)
        assert prefill_jobs(cluster) == ["d0"]
        want = hf_greedy(tiny_dir, prompt, 8)
        assert cluster.tokens("calm") == {0: want}
        assert cluster.tokens("busy") == {0: want}
        assert cluster.coordinator.decisions == {"disaggregated": 1, "local_prefill_busy": 1}
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


def test_off_by_default(tiny_dir) -> None:
    cluster = make(tiny_dir)
    try:
        cluster.submit("r", prompts(512, [1], seed=52)[0], SPEC)
        assert prefill_jobs(cluster) == ["p0"]
    finally:
        cluster.close()
    with pytest.raises(ValueError, match=">= 0"):
        make(tiny_dir, max_local_prefill_tokens=-1)


def test_served_cluster_counts_decisions_in_metrics(tiny_dir) -> None:
    c = ServedCluster(tiny_dir, "--num-kv-blocks=512", "--max-local-prefill-tokens=8")
    try:
        body = {"model": c.model_name, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        for prompt in ("hi", "a much longer prompt that is over eight tokens for sure, yes"):
            r = httpx.post(f"{c.url}/v1/completions", json={**body, "prompt": prompt}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # the figures come with the next ClusterState
        routed = ('reason="local_short_prompt"}', 'reason="disaggregated"}')
        wait_until(lambda: all(r in c.metrics() for r in routed), what="both routes in /metrics")
        text = c.metrics()
        assert 'pdserve_routing_decisions_total{reason="local_short_prompt"} 1.0' in text, text
        assert 'pdserve_routing_decisions_total{reason="disaggregated"} 1.0' in text
    finally:
        c.stop()


def test_a_next_turn_short_past_its_cached_history_stays_local(tiny_dir) -> None:
    """The rule counts what the decode worker would compute: a long history it holds (from
    the first turn) plus a few new tokens is short."""
    cluster = make(tiny_dir, max_local_prefill_tokens=12)
    try:
        first = prompts(512, [40], seed=53)[0]
        cluster.submit("turn1", first, SPEC)
        assert prefill_jobs(cluster) == ["p0"]
        answer = cluster.tokens("turn1")[0]
        cluster.heartbeats()  # the decode worker's cache: 47 tokens' KV, 11 full blocks
        second = first + answer + prompts(512, [5], seed=54)[0]  # 53 tokens, 9 not cached
        cluster.submit("turn2", second, SPEC)
        assert prefill_jobs(cluster) == ["d0"]
        assert cluster.tokens("turn2") == {0: hf_greedy(tiny_dir, second, 8)}
        assert cluster.coordinator.decisions == {"disaggregated": 1, "local_short_prompt": 1}
        assert cluster.workers["d0"].engine.prefill_tokens_computed == 53 - 44
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()
