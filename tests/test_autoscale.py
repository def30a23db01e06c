"""The autoscaler (launch/autoscale.py) against a fake pool of worker processes and a scripted
plan: it grows into empty slots, retires by drain (a slot is free only once its worker exited),
never goes below one worker per role or above --max-workers, turns a worker's role by
drain-and-restart in the same slot, kills a worker still draining past the timeout; and the
parts around it: reading /planner and /metrics, serve's flags and worker commands, and serve's
supervisor leaving a retired worker dead while it restarts a crashed one."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.launch import serve
from pdserve.launch.autoscale import Autoscaler, SlotState, check_autoscale_args
from pdserve.launch.children import Child
from pdserve.launch.plan_source import Desired, parse_plan, worker_loads
from pdserve.launch.serve import Cluster, add_serve_args
from pdserve.launch.worker_commands import worker_command, worker_commands

PERIOD = 2.0
DRAIN = 40.0


@dataclass
class FakeProc:
    """A worker: alive until the test lets it exit (a drain ends) or it is killed."""

    worker_id: str
    running: bool = True
    signals: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.running

    def kill(self) -> None:
        self.signals.append("KILL")
        self.running = False


@dataclass
class FakePool:
    calls: list[tuple] = field(default_factory=list)
    procs: dict[str, FakeProc] = field(default_factory=dict)

    def start_worker(self, role: str, slot: int, worker_id: str) -> FakeProc:
        self.calls.append(("start", role, slot, worker_id))
        self.procs[worker_id] = FakeProc(worker_id)
        return self.procs[worker_id]

    def retire(self, proc: FakeProc) -> None:
        self.calls.append(("retire", proc.worker_id))
        proc.signals.append("TERM")

    def exit(self, worker_id: str) -> None:
        self.procs[worker_id].running = False


@dataclass
class Scaled:
    scaler: Autoscaler
    pool: FakePool
    log: list[str]
    plans: list[Desired | None]
    load: dict[str, int]
    now: float = 0.0

    def period(self, plan: Desired | None) -> None:
        """One period later, the planner says ``plan``."""
        self.plans.append(plan)
        self.now += PERIOD
        self.scaler.tick(self.now)

    def reap(self) -> None:
        """A tick within the period: no new plan is read."""
        self.now += 0.2
        self.scaler.tick(self.now)

    def counts(self) -> tuple[int, int, int]:
        s = self.scaler
        draining = sum(slot.state is SlotState.DRAINING for slot in s.slots)
        return s.live("prefill"), s.live("decode"), draining

    def take_log(self) -> list[str]:
        out = list(self.log)
        self.log.clear()
        return out


def scaled(prefill: int, decode: int, max_workers: int) -> Scaled:
    """An autoscaler holding ``prefill`` then ``decode`` workers started with the cluster."""
    pool, log, plans, load = FakePool(), [], [], {}
    scaler = Autoscaler(
        pool,
        lambda: plans.pop(0) if plans else None,  # past the script: no plan
        lambda: load,
        max_workers=max_workers,
        drain_timeout_s=DRAIN,
        period_s=PERIOD,
        log=log.append,
    )
    for i, role in enumerate(["prefill"] * prefill + ["decode"] * decode):
        pool.procs[f"{role}-{i}"] = FakeProc(f"{role}-{i}")
        scaler.adopt(role, f"{role}-{i}", pool.procs[f"{role}-{i}"])
    return Scaled(scaler, pool, log, plans, load)


def test_grows_one_worker_a_period_up_to_max_workers() -> None:
    s = scaled(1, 1, max_workers=3)
    s.period(Desired(1, 4, "kv 90% used"))
    assert s.pool.calls == [("start", "decode", 2, "decode-2")]
    assert s.take_log() == [
        "plan: prefill 1, decode 4 (kv 90% used)",
        "grow decode 1 -> 2: start decode-2 in slot worker-2 (plan: kv 90% used)",
    ]
    for _ in range(3):  # every slot taken and prefill at its minimum: the plan waits
        s.period(Desired(1, 4, "kv 90% used"))
    assert s.pool.calls == [("start", "decode", 2, "decode-2")]
    assert s.take_log() == []
    assert s.counts() == (1, 2, 0)


def test_no_plan_no_change_and_the_plan_is_read_once_a_period() -> None:
    s = scaled(1, 1, max_workers=4)
    s.period(None)  # the gateway does not answer yet
    s.reap()
    s.plans.append(Desired(1, 3, "x"))
    s.reap()  # within the period: the plan is not read
    assert (s.pool.calls, s.plans) == ([], [Desired(1, 3, "x")])
    s.now += PERIOD
    s.scaler.tick(s.now)
    assert s.pool.calls == [("start", "decode", 2, "decode-2")]


def test_both_roles_grow_in_one_period_the_larger_deficit_first() -> None:
    s = scaled(1, 1, max_workers=3)
    s.period(Desired(2, 3, "both"))
    assert s.pool.calls == [("start", "decode", 2, "decode-2")]  # one slot left: decode's
    s = scaled(1, 1, max_workers=4)
    s.period(Desired(2, 2, "both"))
    assert s.pool.calls == [
        ("start", "decode", 2, "decode-2"),
        ("start", "prefill", 3, "prefill-3"),
    ]


def test_shrinks_by_drain_the_least_loaded_and_frees_the_slot_only_at_exit() -> None:
    s = scaled(1, 3, max_workers=4)
    s.load.update({"decode-1": 3, "decode-2": 1, "decode-3": 2, "prefill-0": 0})
    s.period(Desired(1, 1, "idle"))
    assert s.pool.calls == [("retire", "decode-2")]
    assert s.pool.procs["decode-2"].signals == ["TERM"]
    assert s.take_log() == [
        "plan: prefill 1, decode 1 (idle)",
        "shrink decode 3 -> 2: drain decode-2 (slot worker-2, 1 in flight) (plan: idle)",
    ]
    assert s.counts() == (1, 2, 1)  # draining: no capacity, but its slot is taken
    s.period(Desired(1, 1, "idle"))
    assert s.pool.calls[1:] == [("retire", "decode-3")]
    s.period(Desired(1, 1, "idle"))  # decode at its minimum of one
    assert s.pool.calls[2:] == []
    assert s.counts() == (1, 1, 2)
    s.pool.exit("decode-3")
    s.reap()
    assert s.take_log()[-1] == "retired decode-3 (slot worker-3 free)"
    assert s.counts() == (1, 1, 1)
    s.period(Desired(2, 1, "long prompts"))  # into the slot decode-3 left
    assert s.pool.calls[2:] == [("start", "prefill", 3, "prefill-4")]
    assert s.counts() == (2, 1, 1)


def test_a_slot_draining_for_a_shrink_restarts_in_the_role_that_grows() -> None:
    """Every slot taken, one draining because the plan shrank decode: when the next plan grows
    prefill, that slot restarts as prefill once its worker exited (no second worker drained)."""
    s = scaled(1, 2, max_workers=3)
    s.period(Desired(1, 1, "quiet"))
    s.period(Desired(2, 1, "long prompts"))
    s.period(Desired(2, 1, "long prompts"))  # the turn under way is the change: nothing more
    assert s.pool.calls == [("retire", "decode-2")]
    assert s.take_log()[2:] == [
        "plan: prefill 2, decode 1 (long prompts)",
        "turn decode -> prefill: slot worker-2 restarts once decode-2 has drained "
        "(plan: long prompts)",
    ]
    s.pool.exit("decode-2")
    s.reap()
    assert s.pool.calls[1:] == [("start", "prefill", 2, "prefill-3")]
    assert s.take_log() == [
        "retired decode-2 (slot worker-2 free)",
        "turned slot worker-2 to prefill: start prefill-3",
    ]
    assert s.counts() == (2, 1, 0)


def test_ties_retire_the_most_recently_started() -> None:
    s = scaled(1, 1, max_workers=4)
    s.period(Desired(1, 3, "up"))
    s.period(Desired(1, 3, "up"))
    s.period(Desired(1, 1, "down"))  # no load figures: all equal
    assert s.pool.calls[-1] == ("retire", "decode-3")


def test_never_below_one_worker_per_role() -> None:
    s = scaled(1, 1, max_workers=2)
    for _ in range(3):
        s.period(Desired(0, 0, "nothing"))
    assert s.pool.calls == []
    assert s.counts() == (1, 1, 0)


def test_turns_a_role_by_drain_and_restart_in_the_same_slot() -> None:
    s = scaled(1, 2, max_workers=3)
    s.load.update({"decode-1": 0, "decode-2": 4})
    s.period(Desired(2, 1, "prompts got longer"))
    assert s.pool.calls == [("retire", "decode-1")]
    assert s.take_log() == [
        "plan: prefill 2, decode 1 (prompts got longer)",
        "turn decode -> prefill (prefill/decode mix changed): drain decode-1 "
        "(slot worker-1, 0 in flight) (plan: prompts got longer)",
    ]
    s.period(Desired(2, 1, "prompts got longer"))  # the turn under way is the change
    assert s.pool.calls == [("retire", "decode-1")]
    s.pool.exit("decode-1")
    s.reap()
    assert s.pool.calls[1:] == [("start", "prefill", 1, "prefill-3")]
    assert s.take_log() == [
        "retired decode-1 (slot worker-1 free)",
        "turned slot worker-1 to prefill: start prefill-3",
    ]
    assert s.counts() == (2, 1, 0)


def test_a_turn_the_plan_dropped_leaves_its_slot_empty() -> None:
    s = scaled(1, 2, max_workers=3)
    s.period(Desired(2, 1, "long"))
    s.period(Desired(1, 1, "quiet"))  # no more prefill wanted; decode is already 1
    s.pool.exit("decode-2")
    s.reap()
    assert s.take_log()[-2:] == [
        "retired decode-2 (slot worker-2 free)",
        "slot worker-2 stays empty: the plan no longer wants prefill",
    ]
    assert s.pool.calls == [("retire", "decode-2")]
    assert s.counts() == (1, 1, 0)


def test_a_worker_still_draining_past_the_timeout_is_killed() -> None:
    s = scaled(1, 2, max_workers=3)
    s.period(Desired(1, 1, "idle"))
    assert s.pool.calls == [("retire", "decode-2")]
    s.now += DRAIN - 0.3  # the next tick is 0.1 s short of the deadline
    s.reap()  # not yet
    assert s.pool.procs["decode-2"].signals == ["TERM"]
    s.reap()
    assert s.pool.procs["decode-2"].signals == ["TERM", "KILL"]
    s.reap()
    assert s.take_log()[-2:] == [
        "killed decode-2: still draining after 40s",
        "retired decode-2 (slot worker-2 free)",
    ]
    assert s.counts() == (1, 1, 0)


def test_adopting_more_workers_than_slots_is_refused() -> None:
    s = scaled(1, 1, max_workers=2)
    with pytest.raises(ValueError, match="more starting workers than --max-workers"):
        s.scaler.adopt("decode", "decode-9", FakeProc("decode-9"))


def test_parse_plan() -> None:
    doc = {
        "models": [
            {"model": "other", "prefill": 9, "decode": 9, "reason": "no"},
            {"model": "m", "prefill": 1, "decode": 3, "reason": "r" * 500, "load": {}},
        ]
    }
    assert parse_plan(doc, "m") == Desired(1, 3, "r" * 300)
    assert parse_plan(doc, "absent") is None
    for bad in (True, -1, 4097, 1.0, "2", None):
        entry = {"model": "m", "prefill": 1, "decode": bad}
        assert parse_plan({"models": [entry]}, "m") is None, bad
    assert parse_plan({"models": [{"model": "m", "prefill": 1, "decode": 2}]}, "m") == Desired(
        1, 2, ""
    )
    for bad_doc in ([], {"models": {}}, {"models": ["m"]}, "x"):
        assert parse_plan(bad_doc, "m") is None


def test_worker_loads_from_metrics() -> None:
    text = (
        "# TYPE pdserve_requests_running gauge\n"
        'pdserve_requests_running{role="decode",worker="decode-1"} 3.0\n'
        'pdserve_requests_waiting{role="decode",worker="decode-1"} 2.0\n'
        'pdserve_requests_running{role="prefill",worker="prefill-0"} 0.0\n'
        'pdserve_kv_blocks_used{role="decode",worker="decode-1"} 40.0\n'
        'pdserve_requests_running{role="decode",worker="decode-2"} NaN\n'
    )
    assert worker_loads(text) == {"decode-1": 5, "prefill-0": 0}


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["--model=/models/tiny", *flags])


def test_serve_flags_are_checked() -> None:
    args = serve_args("--autoscale")
    assert check_autoscale_args(args, cores=6) is None
    assert (args.max_workers, args.autoscale_interval) == (6, args.planner_interval)
    assert args.planner_max_workers == 6  # the planner asks for no more than there are slots
    cases = [
        (["--max-workers=3"], "--max-workers and --autoscale-interval are for --autoscale"),
        (["--autoscale-interval=1"], "--max-workers and --autoscale-interval are for"),
        (["--autoscale", "--mode=colocated"], "it needs --mode disagg"),
        (["--autoscale", "--max-workers=1"], "--max-workers must be >= 2"),
        (["--autoscale", "--max-workers=3", "--decode=3"], "--decode 3: at least 1 each and 3"),
        (["--autoscale", "--prefill=0"], "--prefill 0 and --decode 1: at least 1 each"),
        (["--autoscale", "--autoscale-interval=0"], "--autoscale-interval must be > 0"),
    ]
    for flags, message in cases:
        problem = check_autoscale_args(serve_args(*flags), cores=6)
        assert problem is not None and message in problem, (flags, problem)
    assert check_autoscale_args(serve_args(), cores=6) is None


def test_autoscaled_workers_share_the_cores_of_max_workers(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/taskset")
    args = serve_args("--autoscale", "--max-workers=4", "--pin")
    assert check_autoscale_args(args, cores=8) is None
    first = worker_commands(args, "tcp://c", "/m")
    assert [c[c.index("-c") + 1] for c in first] == ["0,1", "2,3"]
    assert all("--threads=2" in c for c in first)
    cmd = worker_command(args, "tcp://c", "/m", "decode", 3, "decode-7")
    assert cmd[:3] == ["taskset", "-c", "6,7"]
    assert {"decode", "--threads=2", "--worker-id=decode-7", "--coordinator=tcp://c"} <= set(cmd)
    assert "--threads=4" in worker_commands(serve_args(), "tcp://c", "/m")[0]  # 8 cores / 2


def test_cluster_starts_slots_with_their_identity_and_retires_unsupervised(monkeypatch) -> None:
    monkeypatch.setattr(Child, "start", lambda self: None)
    args = serve_args("--autoscale", "--max-workers=3")
    check_autoscale_args(args, cores=2)
    cluster = Cluster(args, lambda name: [f"--key-name={name}"], Path("/nonexistent"))
    cluster.address, cluster.model = "tcp://c", "/m"
    child = cluster.start_worker("prefill", 2, "prefill-5")
    assert child.role == "prefill"
    assert {"prefill", "--worker-id=prefill-5", "--key-name=worker-2"} <= set(child.cmd)
    assert cluster.workers == [child]
    terminated: list[Child] = []
    monkeypatch.setattr(Child, "terminate", lambda self: terminated.append(self))
    cluster.retire(child)
    assert (cluster.workers, cluster.retiring, terminated) == ([], [child], [child])
    assert child not in cluster.children()


STOPS_ON_SIGTERM = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "open(sys.argv[1], 'w').close()\n"
    "while True:\n"
    "    time.sleep(1)\n"
)


def test_supervisor_restarts_a_crash_but_not_a_retired_worker(tmp_path: Path) -> None:
    """Real processes: serve's supervisor loop restarts a worker that crashes again and again,
    and never the one retired (SIGTERM) before it exited."""
    args = serve_args("--autoscale", "--max-workers=3", "--max-restarts=1000", "--port=9")
    check_autoscale_args(args, cores=2)
    cluster = Cluster(args, lambda name: [], tmp_path / "address")
    up = tmp_path / "up"
    cluster.coordinator.cmd = [sys.executable, "-c", STOPS_ON_SIGTERM, str(tmp_path / "c")]
    retired = Child("decode", [sys.executable, "-c", STOPS_ON_SIGTERM, str(up)])
    crasher = Child("prefill", [sys.executable, "-c", "pass"])
    cluster.workers = [retired, crasher]
    for child in cluster.children():
        child.start()
    stopping = threading.Event()
    supervisor = threading.Thread(target=serve._supervise, args=(cluster, args, "m", stopping))
    supervisor.start()
    try:
        while not up.exists():  # its SIGTERM handler is in place
            stopping.wait(0.05)
        cluster.retire(retired)
        assert retired.proc is not None and retired.proc.wait(60) == 0
        seen = crasher.restarts
        while crasher.restarts < seen + 2:  # the loop went round after the retired one exited
            stopping.wait(0.05)
        assert retired.restarts == 0 and not retired.alive()
    finally:
        stopping.set()
        supervisor.join(60)
        cluster.stop(1)
    assert cluster.workers == [crasher]
