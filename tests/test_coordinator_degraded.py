"""Degraded, not refused: a model whose prefill pool is gone has its decode workers prefill (the
real workers, tokens equal to transformers', every block freed); a prefill job lost with its
worker and no other prefill worker is recomputed by the decode worker holding its blocks; a
model with no worker that can decode holds its requests up to the hold timeout for one to come
back (stepped with a clock)."""

from __future__ import annotations

import time

import pytest

from pdserve.coordinator.coordinator import Coordinator
from pdserve.coordinator.holds import Holds
from pdserve.coordinator.routes import RouteState
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, WorkerLoad
from pdserve.protocol.phases import Phase
from tests.cluster_util import Cluster
from tests.engine_util import hf_greedy, make_engine, prompts
from tests.test_coordinator_waits import Outbox, generate, register, reserved

GREEDY = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def split(tiny_dir):
    """1 prefill + 2 decode workers of the tiny model, in process."""
    engines_p = [make_engine(tiny_dir, max_num_batched_tokens=32)]
    engines_d = [make_engine(tiny_dir) for _ in range(2)]
    c = Cluster(engines_p, engines_d, heartbeat_timeout_s=1e9)
    yield c
    c.close()


def kill(c: Cluster, wid: str) -> None:
    """``wid`` dies: messages to it are lost from now on, its heartbeats stop, and its KV
    transport goes with it (``Cluster.close`` closes only the workers left)."""
    transport = c.transport(wid)
    if transport is not None:
        transport.close()
    c.workers.pop(wid)
    c.kv_events.pop(wid)
    c.coordinator.registry.workers[wid].last_seen = -1e12
    c.coordinator.registry.heartbeat_timeout_s = 60.0
    c.heartbeats()  # the live ones have just been heard
    c.coordinator.tick(time.monotonic())


def deliver_dropping(c: Cluster, dead: str) -> None:
    """Deliver what is queued, a message to ``dead`` lost (it died as it was sent)."""
    while c.bus.queue:
        if c.bus.queue[0][0] == dead:
            c.bus.queue.popleft()
        else:
            c.deliver_next()


def test_with_no_prefill_worker_decode_workers_prefill(split, tiny_dir) -> None:
    kill(split, "p0")
    state = split.coordinator.registry.cluster_state()
    [model] = state.models
    assert model.ready and model.degraded == "no_prefill"
    batch = prompts(512, [5, 30, 70], seed=7)
    for i, p in enumerate(batch):
        split.submit(f"r{i}", p, GREEDY)
    split.pump()
    assert split.errors() == []
    for i, p in enumerate(batch):
        assert split.tokens(f"r{i}") == {0: hf_greedy(tiny_dir, p, 8)}
    assert split.coordinator.decisions["local_no_prefill"] == len(batch)
    assert set(split.used_blocks().values()) == {0}
    assert split.coordinator.routes == {}


def test_a_prefill_lost_with_its_worker_is_recomputed_where_it_decodes(split, tiny_dir) -> None:
    prompt = prompts(512, [40], seed=8)[0]
    split.submit("r", prompt, GREEDY)
    for _ in range(3):  # Generate -> Reserve -> Reserved -> PrefillJob (lost: p0 dies)
        deliver_dropping(split, "p0")
    route = split.coordinator.routes[("r", 0)]
    assert route.state is RouteState.PREFILLING and route.prefill == "p0"
    decode = route.decode
    kill(split, "p0")
    assert split.coordinator.routes[("r", 0)].state is RouteState.LOCAL
    split.pump()
    assert split.errors() == []
    assert split.tokens("r") == {0: hf_greedy(tiny_dir, prompt, 8)}
    assert split.workers[decode].engine.status.num_free_blocks > 0
    assert set(split.used_blocks().values()) == {0}
    assert split.coordinator.routes == {}


# ---- holds, stepped with a clock -----------------------------------------------------------


def held_cluster(hold_s: float = 2.0) -> tuple[Coordinator, Outbox]:
    """p0 and d0 registered at 0 s (the model whole), then d0 silent past its heartbeat
    timeout (5 s) while p0 heartbeats: the model has no worker that can decode."""
    out = Outbox()
    c = Coordinator(out, heartbeat_timeout_s=5.0, hold_timeout_s=hold_s)
    register(c, "decode", "d0", 64)
    register(c, "prefill", "p0", 64)
    c.handle(Heartbeat(worker_id="p0", load=WorkerLoad.idle(64)), 4.0)
    c.tick(6.0)
    assert "d0" not in c.registry.workers
    out.workers.clear()
    return c, out


def test_a_request_waits_for_its_decode_worker_to_come_back() -> None:
    c, out = held_cluster()
    [model] = c.registry.cluster_state().models
    assert model.ready and model.degraded == "holding"  # gateways still send its requests
    generate(c, "r", now=6.0)
    assert out.gateway == [] and out.take(m.Reserve) == [] and len(c.holds) == 1
    c.tick(7.0)  # still away: it waits on
    assert out.gateway == [] and len(c.holds) == 1
    register(c, "decode", "d0", 64)  # restarted: the held request goes to it at once
    assert [w for w, _ in out.take(m.Reserve)] == ["d0"] and len(c.holds) == 0
    assert c.routes[("r", 0)].state is RouteState.RESERVING


def test_a_held_requests_wait_counts_in_its_coordinator_wait() -> None:
    """Held at 6.0 s, let go at 7.0 (its decode worker back), reserved at 7.5: the prefill job
    says coordinator_wait 1.5 s; one let go to a decode worker that prefills it itself (no
    prefill worker: a local job, which has no coordinator_wait otherwise) says its hold."""
    c, out = held_cluster()
    generate(c, "r", now=6.0)
    register(c, "decode", "d0", 64, now=7.0)
    assert [w for w, _ in out.take(m.Reserve)] == ["d0"]
    c.handle(reserved("d0", "r"), 7.5)
    [(_, job)] = out.take(m.PrefillJob)
    assert job.phases == {Phase.COORDINATOR_WAIT: 1.5}
    generate(c, "fresh", now=7.5)  # never held: counted from its Generate
    c.handle(reserved("d0", "fresh"), 7.75)
    [(_, job)] = out.take(m.PrefillJob)
    assert job.phases == {Phase.COORDINATOR_WAIT: 0.25}
    c.tick(12.5)  # p0 (last heard at 4.0) and d0 (at 7.0) silent past 5 s: both away
    generate(c, "local", now=12.5)
    assert len(c.holds) == 1
    register(c, "decode", "d0", 64, now=13.5)  # no prefill worker: d0 prefills it itself
    [(wid, job)] = out.take(m.PrefillJob)
    assert wid == "d0" and job.dst_block_ids == [] and job.request_id == "local"
    assert job.phases == {Phase.COORDINATOR_WAIT: 1.0}


def test_a_held_request_fails_after_the_hold_timeout() -> None:
    c, out = held_cluster(hold_s=2.0)
    generate(c, "r", now=6.0)
    c.tick(7.9)
    assert out.gateway == []
    c.tick(8.0)
    [error] = out.gateway
    assert isinstance(error, m.RequestError) and error.status == 503
    assert "had no worker to take it for 2.0 s" in error.message
    assert len(c.holds) == 0 and c.routes == {}


def test_an_abort_takes_a_held_request_out() -> None:
    c, out = held_cluster()
    generate(c, "r", now=6.0)
    c.handle(m.Abort("r", "client gone"), 6.5)
    assert len(c.holds) == 0
    register(c, "decode", "d0", 64)
    assert out.take(m.Reserve) == []


def test_no_hold_refuses_at_once_and_a_model_never_whole_is_not_held() -> None:
    c, out = held_cluster(hold_s=0.0)
    [model] = c.registry.cluster_state().models
    assert not model.ready  # gateways refuse it themselves, as before
    generate(c, "r", now=6.0)
    [error] = out.gateway
    assert isinstance(error, m.RequestError) and error.status == 503
    starting, out2 = Coordinator(Outbox(), hold_timeout_s=10.0), None
    out2 = starting.shared.outbox
    register(starting, "decode", "d0", 64)  # its prefill worker not registered yet
    generate(starting, "s")
    [error] = out2.gateway  # type: ignore[attr-defined]
    assert "has no prefill and decode workers yet" in error.message
    assert len(starting.holds) == 0


def test_holds_are_bounded() -> None:
    holds = Holds(5.0, max_held=2)
    reqs = [
        m.Generate(
            request_id=f"r{i}",
            model="tiny",
            prompt_token_ids=[1],
            sampling=m.SamplingParams(max_tokens=1),
            n=1,
            stream_address="gw",
        )
        for i in range(3)
    ]
    assert [holds.hold(r, 0.0) for r in reqs] == [True, True, False]
    with pytest.raises(ValueError):
        Holds(-1.0)


def test_a_resume_of_a_stream_its_worker_still_runs_lets_it_go_on(split, tiny_dir) -> None:
    """A worker taken for dead (heartbeats missed under load) but alive is asked to resume a
    stream it still runs: the stream goes on there, once, with no error (it was a 400,
    "already running")."""
    prompt = prompts(512, [12], seed=9)[0]
    spec = m.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    split.submit("r", prompt, spec)
    while not (running := [w for w in ("d0", "d1") if split.workers[w].engine.has_unfinished()]):
        split.pump_round()
    [wid] = running
    while split.tokens_sent("r") < 4:
        split.pump_round()
    so_far = [t for c in split.chunks() if c.request_id == "r" for t in c.token_ids][:3]
    resume = m.PrefillJob(
        request_id="r",
        prompt_token_ids=prompt,
        sampling=spec,
        n=1,
        dst_block_ids=[],
        transfer_address="",
        stream_address="gw",
        generated_token_ids=so_far,
    )
    split.workers[wid].handle(resume)
    split.pump()
    assert split.errors() == []
    assert split.tokens("r") == {0: hf_greedy(tiny_dir, prompt, 24)}
    assert set(split.used_blocks().values()) == {0}
