"""``n > 1`` through the cluster: one prefill and one transfer for all the choices, forked on
the decode worker (tokens equal to single-choice runs), and every block freed on every path."""

from __future__ import annotations

import pytest

from pdserve.decode.record import DecodeState
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey
from pdserve.protocol.sampling import SamplingParams
from tests.cluster_util import Cluster
from tests.engine_util import hf_greedy, make_engine, prompts

GREEDY = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = m.SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)


@pytest.fixture
def clusters(tiny_dir):
    made: list[Cluster] = []

    def make(colocated: bool = False, **kw) -> Cluster:
        engines_p = [] if colocated else [make_engine(tiny_dir)]
        c = Cluster(engines_p, [make_engine(tiny_dir)], colocated=colocated, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def single_runs(tiny_dir, prompt: list[int], n: int) -> dict[int, list[int]]:
    """Choice c of a request seeded 11 equals a request of its own seeded 11 + c."""
    engine = make_engine(tiny_dir)
    out = {}
    for c in range(n):
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=11 + c, ignore_eos=True)
        out[c] = engine.generate([prompt], params)[0].new_token_ids
    return out


def assert_idle(cluster: Cluster) -> None:
    assert set(cluster.used_blocks().values()) == {0}
    assert cluster.coordinator.routes == {}
    for w in cluster.workers.values():
        assert not w.in_flight()
        assert not w.records
        engine = w.engine
        assert not engine.requests and not engine.requests.held and not engine.requests.due
        assert not engine.scheduler.has_unfinished() and not engine.scheduler.waiting_for_kvs


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_n4_prefills_and_moves_the_prompt_once(clusters, tiny_dir, backend: str) -> None:
    cluster = clusters(backend=backend)
    prompt = prompts(512, [50], seed=70)[0]  # 13 blocks of 4 tokens, the last one partial
    cluster.submit("r", prompt, GREEDY, n=4)
    cluster.pump()
    expected = hf_greedy(tiny_dir, prompt, 8)
    assert cluster.tokens("r") == {c: expected for c in range(4)}
    prefill = cluster.workers["p0"]
    assert prefill.engine.prefill_tokens_computed == 50  # not 200
    assert prefill.blocks_sent == 13  # one transfer, not four
    # the decode worker computed no prompt token: only each choice's decode steps
    assert cluster.workers["d0"].engine.prefill_tokens_computed == 0
    assert cluster.coordinator.decisions["disaggregated"] == 4
    assert_idle(cluster)


@pytest.mark.parametrize("colocated", [False, True])
def test_seeded_choices_equal_their_own_runs(clusters, tiny_dir, colocated: bool) -> None:
    cluster = clusters(colocated=colocated)
    prompt = prompts(512, [21], seed=71)[0]
    cluster.submit("r", prompt, SAMPLED, n=3)
    cluster.pump()
    got = cluster.tokens("r")
    assert got == single_runs(tiny_dir, prompt, 3)
    assert len({tuple(t) for t in got.values()}) > 1
    worker = cluster.workers["d0" if colocated else "p0"]
    assert worker.engine.prefill_tokens_computed == 21
    assert_idle(cluster)


def test_a_choice_ended_by_token_0_does_not_decode(clusters, tiny_dir) -> None:
    prompt = prompts(512, [13], seed=72)[0]
    firsts = {c: t[0] for c, t in single_runs(tiny_dir, prompt, 3).items()}
    # the premise (deterministic): the three seeded choices draw three different tokens 0
    assert len(set(firsts.values())) == 3, firsts
    cluster = clusters()
    spec = m.SamplingParams(
        max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, stop_token_ids=[firsts[1]]
    )
    cluster.submit("r", prompt, spec, n=3)
    cluster.pump()
    got = cluster.tokens("r")
    assert got[1] == [firsts[1]]
    finals = {c.choice: c.finish_reason for c in cluster.chunks() if c.finished}
    assert finals[1] == "stop"
    assert len(got[0]) <= 8 and len(got[2]) <= 8 and got[0][0] == firsts[0]
    assert_idle(cluster)


def test_every_choice_ended_by_token_0_frees_the_reservation(clusters) -> None:
    cluster = clusters()
    spec = m.SamplingParams(max_tokens=1, temperature=1.0, seed=3)
    cluster.submit("r", prompts(512, [10], seed=73)[0], spec, n=4)
    cluster.pump()
    assert {c: len(t) for c, t in cluster.tokens("r").items()} == {0: 1, 1: 1, 2: 1, 3: 1}
    assert cluster.workers["p0"].blocks_sent == 0  # nothing to decode, nothing moved
    assert_idle(cluster)


def test_abort_while_decoding_frees_every_choice(clusters) -> None:
    cluster = clusters()
    spec = m.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    cluster.submit("r", prompts(512, [30], seed=74)[0], spec, n=4)
    for _ in range(200):
        cluster.pump_round()
        if len(cluster.workers["d0"].keys_in(DecodeState.RUNNING)) == 4:
            break
    assert len(cluster.workers["d0"].keys_in(DecodeState.RUNNING)) == 4
    cluster.bus.queue.append(("coordinator", m.Abort("r", "client disconnected")))
    cluster.pump()
    assert_idle(cluster)


def test_abort_before_the_transfer_frees_the_shared_reservation(clusters) -> None:
    cluster = clusters()
    cluster.submit("r", prompts(512, [30], seed=75)[0], GREEDY, n=4)
    for _ in range(50):
        cluster.deliver_next() if cluster.bus.queue else None
        if cluster.workers["d0"].keys_in(DecodeState.RESERVED):
            break
    # one reservation for the four
    assert cluster.workers["d0"].keys_in(DecodeState.RESERVED) == [ChoiceKey("r", 0)]
    assert list(cluster.workers["d0"].engine.scheduler.waiting_for_kvs) == [ChoiceKey("r", 0)]
    cluster.bus.queue.append(("coordinator", m.Abort("r", "client disconnected")))
    cluster.pump()
    assert_idle(cluster)


@pytest.mark.parametrize("mode", ["drop", "corrupt"])
def test_a_failed_transfer_recomputes_each_choice(clusters, tiny_dir, mode: str) -> None:
    cluster = clusters(fault=FaultPlan(mode), transfer_timeout_s=0.5)
    prompt = prompts(512, [23], seed=76)[0]
    cluster.submit("r", prompt, SAMPLED, n=3)
    cluster.pump()
    assert cluster.tokens("r") == single_runs(tiny_dir, prompt, 3)
    assert cluster.errors() == []
    assert_idle(cluster)
