"""KV-aware routing through the in-process cluster (2 prefill workers, 1 or 2 decode): a prompt
goes to the prefill worker that holds its prefix, the hot-spot guard spreads a hot prefix,
evictions and restarts leave the index, outputs stay token-exact; ``load`` and
``round-robin`` place as named."""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

import httpx
import pytest

from pdserve.coordinator.main import add_coordinator_args, add_routing_args, routing_flags
from pdserve.protocol import messages as m
from pdserve.protocol.prefix import block_hashes
from tests.cluster_util import Cluster
from tests.e2e_util import ServedCluster
from tests.engine_util import hf_greedy, make_engine, prompts
from tests.gateway_util import wait_until

SPEC = m.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cluster_factory(tiny_dir):
    made: list[Cluster] = []

    def make(num_d: int = 1, prefill_blocks: int = 512, **options) -> Cluster:
        engines_p = [make_engine(tiny_dir, num_blocks=prefill_blocks) for _ in range(2)]
        engines_d = [make_engine(tiny_dir) for _ in range(num_d)]
        c = Cluster(engines_p, engines_d, **options)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def placed(cluster: Cluster) -> list[str]:
    """Run the cluster until idle; which workers were sent a PrefillJob, in order."""
    return sent_to(cluster)[m.PrefillJob]


def sent_to(cluster: Cluster) -> dict[type[m.Message], list[str]]:
    """Run the cluster until idle; the workers sent each PrefillJob and Reserve, in order."""
    sent: dict[type[m.Message], list[str]] = {m.PrefillJob: [], m.Reserve: []}
    handles = {wid: w.handle for wid, w in cluster.workers.items()}

    def recording(wid: str):
        def handle(msg: m.Message) -> None:
            if type(msg) in sent:
                sent[type(msg)].append(wid)
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


def hashes(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, 4, [])


def first_chunk(cluster: Cluster, request_id: str) -> m.TokenChunk:
    return next(c for c in cluster.chunks() if c.request_id == request_id and c.index == 0)


def warm(cluster: Cluster, other: list[int], shared: list[int]) -> None:
    """``other`` prefilled on p0, ``shared`` on p1; then a period's KVEvents and heartbeats."""
    cluster.submit("other", other, SPEC)
    cluster.submit("shared", shared, SPEC)
    assert placed(cluster) == ["p0", "p1"]
    cluster.heartbeats()


@pytest.mark.parametrize("routing", ["kv", "load"])
def test_a_repeated_prefix_goes_to_the_worker_that_holds_it(
    cluster_factory, tiny_dir, routing
) -> None:
    cluster = cluster_factory(routing=routing)
    other, shared, tail = prompts(512, [40, 40, 12], seed=60)
    warm(cluster, other, shared)
    index = cluster.coordinator.registry.kv
    assert index.held["p1"] == set(cluster.workers["p1"].engine.block_manager.cached)
    assert index.num_held("p1") == 10  # 40 tokens, blocks of 4
    prompt = shared + tail
    cluster.submit("again", prompt, SPEC)
    if routing == "kv":  # p1 holds its first 40 tokens: it computes 12, p0 would compute 52
        assert placed(cluster) == ["p1"]
        assert first_chunk(cluster, "again").num_cached_tokens == 40
        assert cluster.coordinator.placement.decisions == {
            "prefill_kv_miss": 2,
            "prefill_kv_hit": 1,
        }
    else:  # by load both queues are empty: the first worker takes it, and computes it all
        assert placed(cluster) == ["p0"]
        assert first_chunk(cluster, "again").num_cached_tokens == 0
        assert cluster.coordinator.placement.decisions == {"prefill_load": 3}
    assert cluster.tokens("again") == {0: hf_greedy(tiny_dir, prompt, 6)}
    assert set(cluster.used_blocks().values()) == {0}


@pytest.mark.parametrize("guard, expected", [(10, "p1 p1 p0 p1 p1 p1"), (0, "p1 p1 p1 p1 p1 p0")])
def test_the_hot_spot_guard_spreads_a_hot_prefix(cluster_factory, tiny_dir, guard, expected):
    # six prompts = the 40 tokens p1 holds + 8 of their own, all placed before any heartbeat:
    # on p1 each adds 8 tokens to its queue, on p0 48. Unguarded, p1 wins until its queue
    # (40) makes it cost as much as p0; with a 10-token guard, the third one (p1 16 tokens
    # ahead of p0) goes to p0, and once p0's queue is longer p1 wins again.
    cluster = cluster_factory(hot_spot_tokens=guard)
    other, shared, *tails = prompts(512, [40, 40, *[8] * 6], seed=61)
    warm(cluster, other, shared)
    for i, tail in enumerate(tails):
        cluster.submit(f"hot{i}", shared + tail, SPEC)
    assert placed(cluster) == expected.split()
    decisions = cluster.coordinator.placement.decisions
    assert decisions["prefill_kv_hit"] == 5
    assert decisions["prefill_hot_spot_guard"] == (1 if guard else 0)
    p0 = expected.split().index("p0")
    cached = [first_chunk(cluster, f"hot{i}").num_cached_tokens for i in range(6)]
    assert cached == [0 if i == p0 else 40 for i in range(6)]
    for i, tail in enumerate(tails):
        assert cluster.tokens(f"hot{i}") == {0: hf_greedy(tiny_dir, shared + tail, 6)}
    # p0 now holds the prefix too: after a period, both hold its 10 blocks
    cluster.heartbeats()
    hits = cluster.coordinator.registry.kv.prefix_blocks(hashes(shared), ["p0", "p1"])
    assert hits == {"p0": 10, "p1": 10}


def test_an_evicted_prefix_leaves_the_index(cluster_factory, tiny_dir) -> None:
    # 12 blocks a prefill worker: a 47-token prompt (48 with its one output token) on p1 takes
    # every block, evicting all 10 of the 40-token prompt it held
    cluster = cluster_factory(prefill_blocks=12)
    other, shared, filler, other2, tail = prompts(512, [40, 40, 47, 40, 2], seed=62)
    warm(cluster, other, shared)
    assert cluster.coordinator.registry.kv.num_held("p1") == 10
    cluster.submit("other2", other2, SPEC)  # keeps p0 busy, so the filler goes to p1
    cluster.submit("filler", filler, dataclasses.replace(SPEC, max_tokens=1))
    assert placed(cluster) == ["p0", "p1"]
    cluster.heartbeats()
    index = cluster.coordinator.registry.kv
    assert index.held["p1"] == set(cluster.workers["p1"].engine.block_manager.cached)
    assert index.held["p1"].isdisjoint(hashes(shared)) and index.num_held("p1") == 11
    assert index.prefix_blocks(hashes(shared), ["p0", "p1"]) == {"p0": 0, "p1": 0}
    cluster.submit("again", shared + tail, SPEC)
    assert placed(cluster) == ["p0"]  # nobody holds it: by load (a tie: the first)
    assert cluster.coordinator.placement.decisions["prefill_kv_miss"] == 5
    assert cluster.tokens("again") == {0: hf_greedy(tiny_dir, shared + tail, 6)}


def test_a_restarted_worker_is_dropped_from_the_index(cluster_factory, tiny_dir) -> None:
    cluster = cluster_factory()
    other, shared, tail = prompts(512, [40, 40, 12], seed=63)
    warm(cluster, other, shared)
    coordinator = cluster.coordinator
    assert coordinator.registry.kv.num_held("p1") == 10
    # p1 registers again from a new process (a new control address)
    info = coordinator.registry.workers["p1"].info
    coordinator.handle(dataclasses.replace(info, control_address="inproc://p1b"), 0.0)
    assert "p1" in coordinator.registry.workers
    assert coordinator.registry.kv.num_held("p1") == 0 and coordinator.registry.kv.holders
    cluster.submit("again", shared + tail, SPEC)
    assert placed(cluster) == ["p0"]
    assert cluster.tokens("again") == {0: hf_greedy(tiny_dir, shared + tail, 6)}


@pytest.mark.parametrize(
    "routing, prefill, decode",
    [
        ("round-robin", "p0 p1 p0 p1", "d0 d1 d0 d1"),
        # by load: the shortest prefill queue (40, then 8 + 20 + 12 < 40 tokens on p1), the
        # most free decode blocks (d0 gives 11 for the first, then has fewer than d1)
        ("load", "p0 p1 p1 p1", "d0 d1 d1 d1"),
        ("kv", "p0 p1 p1 p1", "d0 d1 d1 d1"),  # nothing cached anywhere: as load
    ],
)
def test_routing_modes_place_as_named(cluster_factory, tiny_dir, routing, prefill, decode):
    cluster = cluster_factory(num_d=2, routing=routing)
    batch = prompts(512, [40, 8, 20, 12], seed=64)
    for i, p in enumerate(batch):
        cluster.submit(f"r{i}", p, SPEC)
    sent = sent_to(cluster)
    assert sent[m.PrefillJob] == prefill.split()
    assert sent[m.Reserve] == decode.split()
    for i, p in enumerate(batch):
        assert cluster.tokens(f"r{i}") == {0: hf_greedy(tiny_dir, p, 6)}
    reason = {"kv": "kv_miss", "load": "load", "round-robin": "round_robin"}[routing]
    assert cluster.coordinator.placement.decisions == {f"prefill_{reason}": 4}


def test_a_bad_routing_mode_is_refused(tiny_dir) -> None:
    with pytest.raises(ValueError, match="routing must be one of kv, load, round-robin"):
        Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir)], routing="cache")
    with pytest.raises(ValueError, match=">= 0 tokens"):
        Cluster([make_engine(tiny_dir)], [make_engine(tiny_dir)], hot_spot_tokens=-1)


def test_routing_decisions_reach_the_cluster_state(cluster_factory) -> None:
    cluster = cluster_factory()
    other, shared = prompts(512, [40, 40], seed=65)
    warm(cluster, other, shared)
    cluster.coordinator.handle(m.GatewayHello("gw"), time.monotonic())
    state = cluster.bus.gateway["gw"][-1]
    assert state.routing == {"disaggregated": 2, "prefill_kv_miss": 2}


def test_serve_passes_the_routing_flags_on() -> None:
    serve = argparse.ArgumentParser()
    add_routing_args(serve)
    flags = routing_flags(serve.parse_args(["--routing=round-robin", "--kv-hot-spot-tokens=64"]))
    coordinator = argparse.ArgumentParser()
    add_coordinator_args(coordinator)
    args = coordinator.parse_args(flags)
    assert (args.routing, args.kv_hot_spot_tokens) == ("round-robin", 64)
    assert coordinator.parse_args([]).routing == "kv"


def prefill_tokens(c: ServedCluster) -> float:
    """Prompt tokens the prefill workers computed or found cached, as /metrics has them."""
    names = "prefill_tokens|prefix_hit_tokens"
    pattern = rf'^pdserve_worker_(?:{names})_total\{{role="prefill",[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, c.metrics(), re.M))


def test_served_cluster_routes_a_repeated_prompt_to_its_cache(tiny_dir) -> None:
    """Real processes: the worker's KVEvents cross CURVE sockets with its heartbeats."""
    c = ServedCluster(tiny_dir, "--prefill=2", "--num-kv-blocks=512", "--routing=kv")
    try:
        prompt = " ".join(f"word{i}" for i in range(60))
        body = {"model": c.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        computed = prefill_tokens(c)
        usages = []
        for _ in range(2):
            r = httpx.post(f"{c.url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
            # A worker sends its period's KVEvents, then its Heartbeat, on one socket: once the
            # coordinator passes on totals that count this prompt's tokens, it has applied the
            # blocks the prompt cached.
            computed += r.json()["usage"]["prompt_tokens"]
            wait_until(lambda want=computed: prefill_tokens(c) >= want, what="the prompt counted")
        n = usages[0]["prompt_tokens"]
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
        assert cached == [0, (n - 1) // 16 * 16]  # blocks of 16: all but the last token's
        wait_until(lambda: "prefill_kv_hit" in c.metrics(), what="the second route in /metrics")
        text = c.metrics()
        assert 'pdserve_routing_decisions_total{reason="prefill_kv_miss"} 1.0' in text, text
        assert 'pdserve_routing_decisions_total{reason="prefill_kv_hit"} 1.0' in text
    finally:
        c.stop()


@pytest.mark.parametrize("routing", ["kv", "round-robin"])
def test_a_next_turn_goes_back_to_the_decode_worker_holding_its_history(
    cluster_factory, tiny_dir, routing
) -> None:
    """With ``kv`` a conversation's second turn reserves on the decode worker whose cache holds
    the first turn (prompt and answer), which then receives only the new blocks."""
    cluster = cluster_factory(num_d=2, routing=routing)
    first = prompts(512, [21], seed=70)[0]
    cluster.submit("turn1", first, SPEC)
    turn1 = sent_to(cluster)[m.Reserve]
    answer = cluster.tokens("turn1")[0]
    cluster.heartbeats()  # KVEvents: the decode worker's cache now holds turn 1
    sent_before = sum(w.blocks_sent for w in cluster.workers.values() if hasattr(w, "sender"))
    second = first + answer + prompts(512, [10], seed=71)[0]  # 37 tokens: 10 blocks
    cluster.submit("turn2", second, SPEC)
    turn2 = sent_to(cluster)[m.Reserve]
    moved = sum(w.blocks_sent for w in cluster.workers.values() if hasattr(w, "sender"))
    assert cluster.tokens("turn2") == {0: hf_greedy(tiny_dir, second, 6)}
    if routing == "kv":  # 26 of turn 1's 27 tokens have KV on that worker: 6 full blocks
        assert turn2 == turn1
        assert moved - sent_before == 10 - 6
        # turn 1 was placed by load: nothing was cached anywhere yet
        assert cluster.coordinator.placement.decode_decisions == {"decode_kv_hit": 1}
    else:
        assert turn2 != turn1
        assert moved - sent_before == 10
    assert set(cluster.used_blocks().values()) == {0}
