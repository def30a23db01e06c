"""Coordinator → prefill → KV transfer → decode, in one process: exact tokens, no leaks."""

from __future__ import annotations

import time

import pytest

from pdserve.decode.record import DecodeState
from pdserve.prefill.worker import PrefillState
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey
from tests.cluster_util import Cluster
from tests.engine_util import hf_greedy, make_engine, prompts

GREEDY = m.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cluster_factory(tiny_dir):
    made: list[Cluster] = []

    def make(num_p: int = 1, num_d: int = 1, backend: str = "zmq", **kw) -> Cluster:
        engines_p = [make_engine(tiny_dir, max_num_batched_tokens=32, **kw) for _ in range(num_p)]
        engines_d = [make_engine(tiny_dir, **kw) for _ in range(num_d)]
        c = Cluster(engines_p, engines_d, backend)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("shape", [(1, 1), (2, 2)])
def test_greedy_through_the_cluster_equals_transformers(cluster_factory, tiny_dir, shape) -> None:
    cluster = cluster_factory(*shape)
    batch = prompts(512)
    for i, p in enumerate(batch):
        cluster.submit(f"r{i}", p, GREEDY)
    cluster.pump()
    for i, p in enumerate(batch):
        assert cluster.tokens(f"r{i}") == {0: hf_greedy(tiny_dir, p, 10)}
    assert set(cluster.used_blocks().values()) == {0}
    assert cluster.coordinator.routes == {}
    if shape == (2, 2):  # work was spread over both workers of each pool
        assert all(w.engine.block_manager.num_cached_blocks for w in cluster.workers.values())


def test_nixl_transfer(cluster_factory, tiny_dir) -> None:
    cluster = cluster_factory(backend="nixl")  # `make test` installs nixl-cu13
    batch = prompts(512, [5, 30], seed=3)
    for i, p in enumerate(batch):
        cluster.submit(f"r{i}", p, GREEDY)
    cluster.pump()
    for i, p in enumerate(batch):
        assert cluster.tokens(f"r{i}") == {0: hf_greedy(tiny_dir, p, 10)}
    assert set(cluster.used_blocks().values()) == {0}


def test_n_choices_and_seeds(cluster_factory) -> None:
    cluster = cluster_factory()
    spec = m.SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    prompt = prompts(512, [9], seed=4)[0]
    cluster.submit("r", prompt, spec, n=3)
    cluster.pump()
    got = cluster.tokens("r")
    assert sorted(got) == [0, 1, 2] and all(len(t) == 6 for t in got.values())
    assert len({tuple(t) for t in got.values()}) > 1  # seeds differ per choice
    # choice c equals a colocated run with seed 5 + c
    colocated = make_engine(cluster.workers["p0"].engine.config.model)
    from pdserve.protocol.sampling import SamplingParams

    for c in range(3):
        ref = colocated.generate(
            [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=5 + c, ignore_eos=True)
        )
        assert got[c] == ref[0].new_token_ids
    assert set(cluster.used_blocks().values()) == {0}


def test_first_token_finishing_releases_the_reservation(cluster_factory) -> None:
    cluster = cluster_factory()
    cluster.submit("r", [1, 2, 3], m.SamplingParams(max_tokens=1, temperature=0.0))
    cluster.pump()
    assert len(cluster.tokens("r")[0]) == 1
    assert set(cluster.used_blocks().values()) == {0}


def test_transfer_done_does_not_wait_for_the_next_prefill_step(cluster_factory, tiny_dir) -> None:
    """The sender's thread reports a finished push: the prefill worker's next step may be a
    long prompt, and the decode worker must not wait for it to end."""
    cluster = cluster_factory()
    prefill = cluster.workers["p0"]
    polls = prefill._poll_transfers
    prefill._poll_transfers = lambda: None  # the worker is inside a step that never ends
    prompt = prompts(512, [20], seed=6)[0]
    cluster.submit("r", prompt, GREEDY)
    while not cluster.tokens_sent("r"):  # until token 0 is out and the push started
        cluster.pump_round()
    assert prefill.keys_in(PrefillState.SENDING) == [ChoiceKey("r", 0)]
    deadline = time.monotonic() + 10
    while not any(isinstance(msg, m.TransferDone) for _, msg in cluster.bus.queue):
        assert time.monotonic() < deadline, "no TransferDone without a prefill step"
        time.sleep(0.01)
    prefill._poll_transfers = polls
    cluster.pump()
    assert cluster.tokens("r") == {0: hf_greedy(tiny_dir, prompt, 10)}
    assert set(cluster.used_blocks().values()) == {0}
    assert not prefill.records  # the transfer's record, reported flag and all, is gone


def test_abort_in_flight_frees_both_sides(cluster_factory) -> None:
    cluster = cluster_factory()
    long_spec = m.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    cluster.submit("r", prompts(512, [40], seed=5)[0], long_spec)
    decode = cluster.workers["d0"]
    while not decode.keys_in(DecodeState.RUNNING):  # prefill done, KV moved, decode under way
        cluster.pump_round()
    cluster.pump_round()
    assert decode.engine.block_manager.num_used_blocks > 0
    cluster.bus.queue.append(("coordinator", m.Abort("r", "client went away")))
    cluster.pump()
    assert set(cluster.used_blocks().values()) == {0}
    assert cluster.coordinator.routes == {}


def test_unknown_model_and_no_capacity(cluster_factory) -> None:
    cluster = cluster_factory(num_blocks=8)

    def unknown(request_id: str) -> m.Generate:
        return m.Generate(
            request_id=request_id,
            model="nope",
            prompt_token_ids=[1],
            sampling=GREEDY,
            n=1,
            stream_address="gw",
        )

    # a coordinator that started less than a heartbeat timeout ago may not have heard every
    # worker register yet (it restarted): an unknown model is a retryable 503 until then
    started = cluster.coordinator.started_at
    cluster.coordinator.handle(unknown("early"), started + 1.0)
    cluster.coordinator.handle(unknown("x"), started + 60.0)
    # 8 blocks x 4 tokens can never hold it: a 400, not a 503 worth retrying
    cluster.submit("big", list(range(100)), GREEDY)
    cluster.pump()
    errors = {e.request_id: e.status for e in cluster.errors()}
    assert errors == {"early": 503, "x": 404, "big": 400}
    assert set(cluster.used_blocks().values()) == {0}


def test_layout_mismatch_is_refused(tiny_dir) -> None:
    a = make_engine(tiny_dir, block_size=4)
    b = make_engine(tiny_dir, block_size=8)
    cluster = Cluster([a], [b])
    try:
        assert list(cluster.coordinator.registry.workers) == ["p0"]
    finally:
        cluster.close()
