"""Coordinator bounds, stepped with a clock and no workers: a reservation or prefill job that
gets no answer moves on or fails, a refusal tries another worker, the free-block estimate
follows every answer, a request that can never fit is a 400, and no Abort or RequestError
leaves a gateway waiting."""

from __future__ import annotations

import pytest

from pdserve.coordinator.coordinator import Coordinator
from pdserve.coordinator.routes import RouteState
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, KVLayout, Register, WorkerLoad
from pdserve.protocol.tenancy import Share

LAYOUT = KVLayout(block_size=16, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8)
SPEC = m.SamplingParams(max_tokens=4)


class Outbox:
    def __init__(self) -> None:
        self.workers: list[tuple[str, m.Message]] = []
        self.gateway: list[m.Message] = []

    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None:
        self.workers.append((worker_id, msg))

    def to_gateway(self, address: str, msg: m.Message) -> None:
        self.gateway.append(msg)

    def forget_worker(self, worker_id: str) -> None:
        pass

    def take(self, kind: type) -> list[tuple[str, m.Message]]:
        """The messages of ``kind`` sent to workers so far, and forget every message."""
        out = [(w, msg) for w, msg in self.workers if isinstance(msg, kind)]
        self.workers.clear()
        return out


def cluster(decode: dict[str, int], prefill: tuple[str, ...] = ("p0",)) -> tuple:
    out = Outbox()
    c = Coordinator(out, heartbeat_timeout_s=1e9, reserve_timeout_s=5, prefill_timeout_s=50)
    for wid, blocks in decode.items():
        register(c, "decode", wid, blocks)
    for wid in prefill:
        register(c, "prefill", wid, 64)
    return c, out


def register(c: Coordinator, role: str, wid: str, blocks: int, now: float = 0.0) -> None:
    """Worker ``wid`` of ``role`` registers with ``blocks`` KV blocks of 16 tokens."""
    c.handle(
        Register(
            role=role,
            worker_id=wid,
            model="tiny",
            control_address=wid,
            transfer_address=f"t-{wid}" if role == "decode" else "",
            transfer_backend="zmq",
            layout=LAYOUT,
            num_blocks=blocks,
        ),
        now,
    )


def generate(
    c: Coordinator, rid: str, prompt_len: int = 20, now: float = 0.0, share: Share | None = None
) -> None:
    c.handle(
        m.Generate(
            request_id=rid,
            model="tiny",
            prompt_token_ids=list(range(prompt_len)),
            sampling=SPEC,
            n=1,
            stream_address="gw",
            share=share,
        ),
        now,
    )


def reserved(wid: str, rid: str, free: int = -1, error: str | None = None) -> m.Reserved:
    ids = [] if error else [1, 2]
    return m.Reserved(
        request_id=rid,
        worker_id=wid,
        block_ids=ids,
        transfer_address=f"t-{wid}",
        error=error,
        choice=0,
        free_blocks=free,
    )


def test_a_black_holed_decode_worker_is_passed_over() -> None:
    c, out = cluster({"d0": 64, "d1": 32})
    generate(c, "r")
    [(first, _)] = out.take(m.Reserve)
    assert first == "d0"  # the most free blocks
    c.tick(4.0)
    assert out.take(m.Reserve) == []
    c.tick(5.5)  # past the reservation timeout: d1 is asked, d0 told to let go
    assert [(w, type(msg)) for w, msg in out.workers] == [("d0", m.Abort), ("d1", m.Reserve)]
    out.workers.clear()
    c.handle(reserved("d1", "r"), 6.0)
    [(p, job)] = out.take(m.PrefillJob)
    # the job pushes into d1's blocks: d1 decodes
    assert (p, job.transfer_address, c.routes[("r", 0)].decode) == ("p0", "t-d1", "d1")
    assert [type(x) for x in out.gateway] == [m.Accepted]
    # d0 still heartbeats with the most free blocks, but gets nothing new for a while
    generate(c, "next", now=7.0)
    assert [w for w, _ in out.take(m.Reserve)] == ["d1"]
    # a late answer from d0 is given back
    c.handle(reserved("d0", "r"), 8.0)
    assert [(w, msg.request_id) for w, msg in out.take(m.Abort)] == [("d0", "r")]


def test_no_other_decode_worker_fails_the_request_with_the_reason() -> None:
    c, out = cluster({"d0": 64})
    generate(c, "r")
    c.tick(6.0)
    [error] = out.gateway
    assert isinstance(error, m.RequestError) and (error.request_id, error.status) == ("r", 503)
    assert "d0 did not answer a reservation" in error.message
    assert c.routes == {}


def test_a_refused_reservation_tries_another_decode_worker_then_waits() -> None:
    c, out = cluster({"d0": 64, "d1": 32})
    generate(c, "r")
    c.handle(reserved("d0", "r", free=0, error="no free blocks"), 0.1)
    assert [w for w, _ in out.take(m.Reserve)] == ["d0", "d1"]
    c.handle(reserved("d1", "r", free=0, error="no free blocks"), 0.2)
    assert out.gateway == [] and c.routes[("r", 0)].state is RouteState.QUEUED
    # blocks come back (a heartbeat says so): the oldest waiting choice is placed
    c.handle(
        Heartbeat(worker_id="d1", load=WorkerLoad.idle(32)),
        1.0,
    )
    assert [w for w, _ in out.take(m.Reserve)] == ["d1"]
    assert c.routes[("r", 0)].state is RouteState.RESERVING


def test_a_full_pool_queues_first_come_first_served_then_times_out() -> None:
    c, out = cluster({"d0": 4})  # 4 blocks of 16 tokens: one 40-token prompt at a time
    for rid in ("a", "b", "c"):
        generate(c, rid, prompt_len=40)
    assert [msg.request_id for _, msg in out.take(m.Reserve)] == ["a"]
    assert [c.routes[(r, 0)].state for r in "bc"] == [RouteState.QUEUED] * 2
    c.handle(m.Abort("c", "client gone"), 0.5)  # a waiting choice can be aborted
    assert ("c", 0) not in c.routes and out.take(m.Abort) == []  # no worker held anything
    c.tick(30.0)  # still full: b waits on
    assert out.take(m.Reserve) == [] and c.routes[("b", 0)].state is RouteState.QUEUED
    c.tick(61.0)  # past the queue timeout: 503 with the reason
    errors = [e for e in out.gateway if isinstance(e, m.RequestError) and e.request_id == "b"]
    assert errors[0].status == 503 and "no decode worker had free KV blocks" in errors[0].message
    assert ("b", 0) not in c.routes


def test_a_silent_prefill_worker_loses_its_job() -> None:
    c, out = cluster({"d0": 64}, prefill=("p0", "p1"))
    generate(c, "r")
    c.handle(reserved("d0", "r"), 0.1)
    [(p, _job)] = out.take(m.PrefillJob)
    c.tick(40.0)
    assert out.workers == []
    c.tick(60.0)
    moved = [(w, type(msg)) for w, msg in out.workers]
    other = ({"p0", "p1"} - {p}).pop()
    assert moved == [(p, m.Abort), (other, m.PrefillJob)]
    out.workers.clear()
    c.tick(120.0)  # and the other one too: its decode worker frees the blocks and prefills it
    assert [x for x in out.gateway if isinstance(x, m.RequestError)] == []
    sent = [(w, type(msg)) for w, msg in out.workers]
    assert sent == [(other, m.Abort), ("d0", m.Abort), ("d0", m.PrefillJob)]  # in this order
    local = out.workers[-1][1]
    assert isinstance(local, m.PrefillJob) and local.dst_block_ids == []
    assert c.routes[("r", 0)].state is RouteState.LOCAL


def test_the_free_block_estimate_follows_every_answer() -> None:
    # 41 of 64 blocks each: the estimate alone (64 - 41) refuses the second request until a
    # heartbeat; the worker's own count in each answer lets all ten through
    c, out = cluster({"d0": 64})
    for i in range(10):
        generate(c, f"r{i}", prompt_len=640, now=float(i))
        assert [w for w, _ in out.take(m.Reserve)] == ["d0"], out.gateway
        c.handle(reserved("d0", f"r{i}", free=64 - 41), i + 0.1)
        c.handle(m.Finished(f"r{i}", 0, "d0"), i + 0.2)  # its blocks are free again
        c.handle(reserved("d0", "gone", free=64), i + 0.3)  # any answer carries the count
    assert not [x for x in out.gateway if isinstance(x, m.RequestError)]


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "what"),
    [(64, 10, "more than the 64"), (300, 4, "context length of 256")],
)
def test_a_request_that_can_never_fit_is_a_400(prompt_len, max_tokens, what) -> None:
    out = Outbox()
    c = Coordinator(out)
    reg = Register(
        role="decode",
        worker_id="d0",
        model="tiny",
        control_address="d0",
        transfer_address="t",
        transfer_backend="zmq",
        layout=LAYOUT,
        num_blocks=4,
        model_root="",
        max_model_len=256,
    )
    c.handle(reg, 0.0)
    c.handle(
        Register(
            role="prefill",
            worker_id="p0",
            model="tiny",
            control_address="p0",
            transfer_address="",
            transfer_backend="zmq",
            layout=LAYOUT,
            num_blocks=64,
            model_root="",
            max_model_len=256,
        ),
        0.0,
    )
    spec = m.SamplingParams(max_tokens=max_tokens)
    c.handle(
        m.Generate(
            request_id="r",
            model="tiny",
            prompt_token_ids=list(range(prompt_len)),
            sampling=spec,
            n=1,
            stream_address="gw",
        ),
        0.0,
    )
    [error] = out.gateway
    assert error.status == 400 and what in error.message, error.message
    assert out.workers == []


def test_a_forged_abort_or_error_ends_the_stream_at_its_gateway() -> None:
    c, out = cluster({"d0": 64})
    for rid in ("a", "b"):
        generate(c, rid)
        c.handle(reserved("d0", rid), 0.1)
    out.gateway.clear()
    c.handle(m.Abort("a", "forged"), 0.2)
    c.handle(m.RequestError(request_id="b", status=500, message="forged failure"), 0.2)
    assert [(e.request_id, e.status, e.message) for e in out.gateway] == [
        ("a", 503, "aborted: forged"),
        ("b", 500, "forged failure"),
    ]
    assert c.routes == {}
    aborted = sorted((w, msg.request_id) for w, msg in out.take(m.Abort))
    assert aborted == [("d0", "a"), ("d0", "b"), ("p0", "a"), ("p0", "b")]
    c.handle(m.Abort("a", "again"), 0.3)  # unknown by now: nothing more to say
    assert len(out.gateway) == 2
