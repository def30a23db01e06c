"""A worker's heartbeats do not depend on how long a step takes; only a wedged loop stops them.

The exact schedule runs on a fake clock; the rest runs ``serve`` with a worker-like loop on
real zmq sockets (loopback, ports picked at run time), a PULL socket standing in for the
coordinator.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, KVLayout, Register, WorkerLoad
from pdserve.runtime.liveness import Liveness
from pdserve.runtime.loop import PushOutbox, serve
from pdserve.runtime.sockets import bound_address, make_socket, recv_msg

LAYOUT = KVLayout(block_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
REGISTER = Register(
    role="both",
    worker_id="w0",
    model="tiny",
    control_address="tcp://127.0.0.1:1",
    transfer_address="",
    transfer_backend="zmq",
    layout=LAYOUT,
    num_blocks=128,
)
PERIOD_S = 0.05
WAIT_S = 60.0  # a bound on every wait below, never a reason for one to pass


def status(running: int, draining: bool = False) -> Heartbeat:
    load = WorkerLoad(
        free_blocks=100,
        used_blocks=28,
        total_blocks=128,
        running=running,
        waiting=0,
        queued_prompt_tokens=0,
        draining=draining,
    )
    return Heartbeat(worker_id="w0", load=load)


# ---- the schedule, on a fake clock -----------------------------------------------------------
def test_keepalives_every_period_each_status_once_and_silence_when_wedged(tmp_path, caplog):
    sent: list[tuple[float, m.Message]] = []
    now = 0.0
    stacks = (tmp_path / "stacks.txt").open("w+")
    lv = Liveness(
        lambda msg: sent.append((now, msg)),
        REGISTER,
        period_s=1.0,
        stall_timeout_s=10.0,
        clock=lambda: now,
        stack_file=stacks,
    )
    hb1, hb2 = status(1), status(2)

    def at(t: float) -> None:
        nonlocal now
        now = t
        lv.tick(t)

    at(0.0)
    at(0.5)  # nothing due
    lv.publish(hb1)
    at(0.6)  # a new status goes out at once
    lv.came_round(2.0)  # then the loop enters a long step
    for t in range(1, 13):
        at(float(t))  # quiet for 10 s at t=12: still within the limit
    assert sent == [(0.0, REGISTER), (0.6, hb1)] + [(float(t), REGISTER) for t in range(1, 13)]
    assert not lv.stalled and "stack" not in caplog.text

    with caplog.at_level(logging.ERROR, logger="pdserve.runtime.liveness"):
        for t in range(13, 20):
            at(float(t))
    assert len(sent) == 14  # silent from t=13: quiet 11 s > 10 s
    assert lv.stalled
    assert "has not come round for 11.0s (stall limit 10.0s)" in caplog.text
    stacks.seek(0)
    dump = stacks.read()
    assert "test_keepalives_every_period_each_status_once" in dump  # this thread's frames

    lv.came_round(20.0)  # the loop is back
    lv.publish(hb2)
    at(20.5)
    at(21.0)  # a keep-alive a period after the one on resuming, not before
    at(21.5)
    assert sent[14:] == [(20.5, REGISTER), (20.5, hb2), (21.5, REGISTER)]
    assert not lv.stalled


def test_a_stall_limit_within_the_period_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stall timeout \(1.0s\) must be longer"):
        Liveness(lambda msg: None, REGISTER, period_s=1.0, stall_timeout_s=1.0)


# ---- serve with a worker-like loop on real sockets -------------------------------------------
class SlowWorker:
    """Its second step runs until the test releases it (a long prefill chunk, or a wedge)."""

    def __init__(self) -> None:
        self.steps = 0
        self.draining = False
        self.in_long_step = threading.Event()
        self.release = threading.Event()

    def step(self) -> bool:
        self.steps += 1
        if self.steps == 2:
            self._long_step()
        return False

    def _long_step(self) -> None:
        self.in_long_step.set()
        assert self.release.wait(WAIT_S), "the test never released the step"

    # Drain
    def begin_drain(self) -> None:
        self.draining = True

    def in_flight(self) -> bool:
        return False


class Rig:
    """``serve`` on a thread: its inbox, a coordinator PULL socket, the sends in order."""

    def __init__(self, zctx: zmq.Context, stall_timeout_s: float, stack_file=None) -> None:
        self.coordinator = make_socket(zctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        self.inbox = make_socket(zctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        self.outbox = PushOutbox(zctx, bound_address(self.coordinator))
        self.worker = SlowWorker()
        self.sends: list[tuple[bool, m.Message]] = []  # (during the long step?, message)
        self.received: list[m.Message] = []
        self.liveness = Liveness(
            self._send, REGISTER, PERIOD_S, stall_timeout_s, stack_file=stack_file
        )
        self.stop = threading.Event()

        def periodic(now: float) -> None:  # the loop thread builds the status
            self.liveness.publish(status(self.worker.steps, self.worker.draining))

        self.thread = threading.Thread(
            target=serve,
            args=(self.inbox, lambda msg: None, self.worker.step, periodic, self.stop),
            kwargs={"period_s": PERIOD_S, "drain": self.worker, "liveness": self.liveness},
        )

    def _send(self, msg: m.Message) -> None:
        w = self.worker
        self.sends.append((w.in_long_step.is_set() and not w.release.is_set(), msg))
        self.outbox.to_coordinator(msg)

    def receive_until(self, done) -> None:
        """Take arrivals (one PUSH socket: in send order) until ``done(self)``."""
        deadline = time.monotonic() + WAIT_S
        while not done(self):
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"gave up after {len(self.received)} arrivals"
            msg = recv_msg(self.coordinator, timeout_ms=left_ms)
            if msg is not None:
                self.received.append(msg)

    def arrived_during_step(self, kind: type) -> int:
        pairs = zip(self.sends, self.received, strict=False)
        return sum(1 for (during, _), got in pairs if during and type(got) is kind)

    def close(self) -> None:
        self.worker.release.set()
        self.stop.set()
        self.thread.join(WAIT_S)
        self.outbox.close()
        self.inbox.close()
        self.coordinator.close()


@pytest.fixture
def rig():
    ctx = zmq.Context()
    rigs: list[Rig] = []

    def make(stall_timeout_s: float, stack_file=None) -> Rig:
        rigs.append(Rig(ctx, stall_timeout_s, stack_file))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()
    ctx.term()


def test_keepalives_arrive_while_a_step_runs_far_past_the_period(rig) -> None:
    r = rig(30.0)
    r.thread.start()
    assert r.worker.in_long_step.wait(WAIT_S)
    # five periods into one step, five keep-alives sent during it have reached the coordinator
    r.receive_until(lambda r: r.arrived_during_step(Register) >= 5)
    assert not r.worker.release.is_set()
    heartbeats = [msg for _, msg in r.sends if isinstance(msg, Heartbeat)]
    assert heartbeats == [status(1)]  # the status from before the step, sent once
    r.worker.release.set()
    # the loop comes round: a fresh status at once; then a stop drains and says so at once
    r.receive_until(lambda r: status(2) in r.received)
    r.stop.set()
    r.receive_until(lambda r: any(isinstance(x, Heartbeat) and x.load.draining for x in r.received))
    r.thread.join(WAIT_S)
    assert not r.thread.is_alive() and not r.liveness._thread.is_alive()  # joined on the way out


def test_a_wedged_loop_goes_silent_with_its_stacks_and_speaks_again(rig, tmp_path, caplog):
    stacks = (tmp_path / "stacks.txt").open("w+")
    r = rig(0.3, stacks)
    silent: list[int] = []  # sends so far, at each tick while stalled
    three_silent_ticks = threading.Event()
    tick = r.liveness.tick

    def counted_tick(now: float) -> None:
        tick(now)
        if r.liveness.stalled:
            silent.append(len(r.sends))
            if len(silent) == 3:
                three_silent_ticks.set()

    r.liveness.tick = counted_tick
    with caplog.at_level(logging.WARNING, logger="pdserve.runtime.liveness"):
        r.thread.start()
        assert r.worker.in_long_step.wait(WAIT_S)
        assert three_silent_ticks.wait(WAIT_S)
        assert silent[0] == silent[1] == silent[2]  # three periods, no keep-alive
        assert "stall limit 0.3s" in caplog.text
        stacks.seek(0)
        assert "in _long_step" in stacks.read()  # every thread's stack, the loop's included
        r.worker.release.set()
        r.receive_until(lambda r: status(2) in r.received)
        assert "came round again: heartbeats resume" in caplog.text
    assert not r.liveness.stalled
    during = [msg for d, msg in r.sends if d]
    assert during and all(msg == REGISTER for msg in during[1:])  # keep-alives, then silence
    assert r.received[silent[0]] == REGISTER  # the first word after the silence
