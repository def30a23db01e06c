"""The planner's seat in the coordinator (``coordinator.planning``), stepped with a clock: the
figures it reads into each model's ``Load`` (arrivals, gateways' samples, the pools' queue, KV
use and live workers), when it plans, the plans in ``ClusterState``, and the local-prefill
threshold it sets when asked to. The policy itself is tested in test_planner.py: here a
recording planner answers with a fixed plan."""

from __future__ import annotations

import pytest

from pdserve.coordinator.coordinator import Coordinator
from pdserve.coordinator.planner import Load, Plan
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, Register, WorkerLoad
from pdserve.protocol.planning import LatencySamples
from tests.test_coordinator_waits import LAYOUT, Outbox, register


class Recording:
    """Answers every plan with (2 prefill, 3 decode, local threshold ``local``)."""

    def __init__(self, local: int = 0) -> None:
        self.loads: list[tuple[float, Load]] = []
        self.local = local

    def plan(self, model: str, load: Load, now: float) -> Plan:
        self.loads.append((now, load))
        return Plan(
            model=model,
            prefill=2,
            decode=3,
            max_local_prefill_tokens=self.local,
            reason="recorded",
            load=load,
        )


class Stepped(Coordinator):
    """A coordinator that remembers the last time it was handed (``now``): these tests' clock."""

    now = 0.0

    def handle(self, msg: m.Message, now: float, sender: str = "") -> None:
        self.now = now
        super().handle(msg, now, sender)

    def tick(self, now: float) -> None:
        self.now = now
        super().tick(now)


def cluster(planner: Recording, **options: object) -> tuple[Stepped, Outbox]:
    out = Outbox()
    c = Stepped(
        out,
        heartbeat_timeout_s=1e9,
        make_planner=lambda model: planner,  # type: ignore[arg-type,return-value]
        planner_interval_s=5.0,
        **options,  # type: ignore[arg-type]
    )
    for role, wid, blocks in (("decode", "d0", 64), ("decode", "d1", 64), ("prefill", "p0", 64)):
        register(c, role, wid, blocks)
    return c, out


def generate(c: Stepped, rid: str, prompt_len: int, max_tokens: int, n: int = 1) -> None:
    c.handle(
        m.Generate(
            request_id=rid,
            model="tiny",
            prompt_token_ids=list(range(prompt_len)),
            sampling=m.SamplingParams(max_tokens=max_tokens),
            n=n,
            stream_address="gw",
        ),
        c.now,
    )


def heartbeat(c: Stepped, wid: str, used: int, running: int, queued: int = 0) -> None:
    load = WorkerLoad(
        free_blocks=64 - used,
        used_blocks=used,
        total_blocks=64,
        running=running,
        waiting=0,
        queued_prompt_tokens=queued,
    )
    c.handle(Heartbeat(worker_id=wid, load=load), c.now)


def test_load_is_read_from_arrivals_samples_and_the_pools() -> None:
    planner = Recording()
    c, out = cluster(planner)
    c.tick(0.0)  # the first plan: nothing has arrived
    assert [now for now, _ in planner.loads] == [0.0]
    c.now = 1.0
    generate(c, "a", prompt_len=100, max_tokens=8)
    generate(c, "b", prompt_len=300, max_tokens=16, n=2)
    hello = m.GatewayHello(
        "gw",
        [
            LatencySamples(
                model="tiny",
                ttft_s=[float(i) / 10 for i in range(1, 11)],
                tpot_s=[0.02, 0.05],
                output_tokens=[10, 30],
            ),
            LatencySamples(model="not-served", ttft_s=[9.0]),  # nobody serves it: ignored
        ],
    )
    c.handle(hello, 1.0)
    heartbeat(c, "d0", used=10, running=2)
    heartbeat(c, "d1", used=20, running=1)
    heartbeat(c, "p0", used=0, running=1, queued=700)
    c.tick(4.0)  # within the interval: no plan
    assert len(planner.loads) == 1
    c.tick(5.0)
    now, load = planner.loads[-1]
    assert now == 5.0
    assert load == Load(
        arrival_rate=3 / 5.0,  # choices over the 5 s watched so far
        prompt_tokens=200.0,
        output_tokens=20.0,  # finished choices' tokens, not max_tokens
        prefill_queue_tokens=700,
        decode_running=3,
        decode_waiting=0,
        kv_used_blocks=30,
        kv_total_blocks=128,
        ttft_p90_s=0.9,
        tpot_p90_s=0.05,
        prefill_workers=1,
        decode_workers=2,
    )
    c.handle(m.GatewayHello("gw"), 5.0)
    (state,) = [msg for msg in out.gateway if isinstance(msg, m.ClusterState)][-1:]
    (report,) = state.plans
    assert (report.model, report.prefill, report.decode, report.reason) == (
        "tiny",
        2,
        3,
        "recorded",
    )
    assert report.load["prefill_queue_tokens"] == 700.0 and report.load["ttft_p90_s"] == 0.9


def test_old_figures_leave_the_window_and_draining_workers_do_not_count() -> None:
    planner = Recording()
    c, _ = cluster(planner)
    c.tick(0.0)
    c.now = 1.0
    generate(c, "a", prompt_len=100, max_tokens=8)
    c.handle(m.GatewayHello("gw", [LatencySamples(model="tiny", ttft_s=[3.0])]), 1.0)
    draining = WorkerLoad(
        free_blocks=64,
        used_blocks=0,
        total_blocks=64,
        running=0,
        waiting=0,
        queued_prompt_tokens=0,
        draining=True,
    )
    c.handle(Heartbeat(worker_id="d1", load=draining), 1.0)
    c.tick(40.0)  # 30 s window: the arrival and the sample are gone
    load = planner.loads[-1][1]
    assert (load.arrival_rate, load.prompt_tokens, load.ttft_p90_s) == (0.0, 0.0, None)
    assert (load.decode_workers, load.prefill_workers, load.kv_total_blocks) == (1, 1, 64)


def test_output_tokens_fall_back_to_max_tokens_before_any_finished() -> None:
    planner = Recording()
    c, _ = cluster(planner)
    c.now = 1.0
    generate(c, "a", prompt_len=10, max_tokens=8)
    generate(c, "b", prompt_len=10, max_tokens=24)
    c.tick(1.0)
    assert planner.loads[-1][1].output_tokens == 16.0


@pytest.mark.parametrize("auto", [True, False])
def test_the_planners_local_threshold_routes_short_prompts_when_auto(auto: bool) -> None:
    planner = Recording(local=64)
    c, out = cluster(planner, auto_local=auto)
    c.tick(0.0)
    generate(c, "short", prompt_len=40, max_tokens=4)
    jobs = [msg for _, msg in out.workers if isinstance(msg, m.PrefillJob)]
    reserves = out.take(m.Reserve)
    if auto:  # prefilled on its decode worker: no reservation for a transfer
        assert reserves == [] and len(jobs) == 1 and jobs[0].dst_block_ids == []
        assert c.decisions["local_short_prompt"] == 1
    else:
        assert len(reserves) == 1 and c.decisions["disaggregated"] == 1


def test_a_hello_with_impossible_samples_is_dropped_whole(caplog) -> None:
    planner = Recording()
    c, _ = cluster(planner)
    bad = LatencySamples(model="tiny", ttft_s=[0.1, float("inf")])
    c.handle(m.GatewayHello("gw", [bad]), 0.0)
    c.tick(0.0)
    assert planner.loads[-1][1].ttft_p90_s is None
    assert "dropped latency samples" in caplog.text


def test_a_colocated_pool_is_not_planned() -> None:
    planner = Recording()
    out = Outbox()
    c = Coordinator(out, heartbeat_timeout_s=1e9, make_planner=lambda model: planner)  # type: ignore[arg-type,return-value]
    register(c, "both", "w0", 64)
    c.tick(0.0)
    assert planner.loads == [] and c.planning.reports() == []


def register_group(c: Stepped, role: str, wid: str, tp: int) -> None:
    """Worker ``wid`` of ``role``: a tensor-parallel group of ``tp`` ranks, 64 KV blocks."""
    c.handle(
        Register(
            role=role,  # type: ignore[arg-type]
            worker_id=wid,
            model="tiny",
            control_address=wid,
            transfer_address=f"t-{wid}" if role == "decode" else "",
            transfer_backend="zmq",
            layout=LAYOUT,
            num_blocks=64,
            tensor_parallel_size=tp,
        ),
        c.now,
    )


def drain(c: Stepped, wid: str) -> None:
    load = WorkerLoad(
        free_blocks=64,
        used_blocks=0,
        total_blocks=64,
        running=0,
        waiting=0,
        queued_prompt_tokens=0,
        draining=True,
    )
    c.handle(Heartbeat(worker_id=wid, load=load), c.now)


def test_the_load_carries_the_size_most_of_each_roles_workers_run_at() -> None:
    planner = Recording()
    c, _ = cluster(planner)  # p0, d0, d1: one rank each

    def sizes(now: float) -> tuple[int, int]:
        c.tick(now)
        load = planner.loads[-1][1]
        return load.prefill_tp, load.decode_tp

    assert sizes(0.0) == (1, 1)
    register_group(c, "prefill", "p1", 2)
    register_group(c, "prefill", "p2", 2)
    register_group(c, "decode", "d0", 4)  # d0 again, now a group of 4
    assert sizes(5.0) == (2, 1)  # two of three prefill workers at 2; decode 4 and 1: a tie
    register_group(c, "decode", "d1", 2)
    assert sizes(10.0) == (2, 2)  # decode 4 and 2: a tie goes to the smaller
    register_group(c, "decode", "d2", 4)
    assert sizes(15.0) == (2, 4)
    drain(c, "d2")  # a draining worker takes no new work: its size does not count
    assert sizes(20.0) == (2, 2)
    for wid in ("p0", "p1", "p2"):
        drain(c, wid)
    assert sizes(25.0) == (1, 2)  # no live prefill worker: 1
    (report,) = c.planning.reports()
    assert (report.load["prefill_tp"], report.load["decode_tp"]) == (1.0, 2.0)
