"""The probes' HTTP server (runtime/health_http.py) on a real socket, and what each role's
probes say: the coordinator's loop ticks (``LoopTicks``), a worker's states
(worker/health.py) and its connection to the coordinator (runtime/coordinator_link.py)."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from pdserve.runtime.coordinator_link import CoordinatorLink
from pdserve.runtime.health_http import (
    MAX_HEAD_BYTES,
    HealthServer,
    LoopTicks,
    add_health_args,
    start_health,
)
from pdserve.worker.health import Serving, WorkerHealth

CLIENT_TIMEOUT_S = 30.0  # only a server that never answers takes this long


class Probes:
    def __init__(self) -> None:
        self.live: str | None = None
        self.ready: str | None = "not yet"

    def livez(self) -> str | None:
        return self.live

    def readyz(self) -> str | None:
        if self.ready == "raise":
            raise RuntimeError("boom")
        return self.ready


@pytest.fixture
def served() -> Iterator[tuple[HealthServer, Probes]]:
    probes = Probes()
    server = HealthServer("127.0.0.1", 0, probes.livez, probes.readyz).start()
    yield server, probes
    server.close()


def ask(port: int, raw: bytes) -> bytes:
    """Everything the server sends back to ``raw``, until it closes the connection."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT_S) as s:
        s.sendall(raw)
        try:
            while chunk := s.recv(4096):
                out += chunk
        except ConnectionResetError:  # closed with some of what was sent unread
            pass
    return out


def get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    raw = f"{method} {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.32\r\n\r\n".encode()
    head, _, body = ask(port, raw).partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def test_each_path_answers_its_probe(served: tuple[HealthServer, Probes]) -> None:
    server, probes = served
    assert get(server.port, "/livez") == (200, b"ok\n")
    assert get(server.port, "/readyz") == (503, b"not yet\n")
    assert get(server.port, "/readyz?verbose=1") == (503, b"not yet\n")  # the query is ignored
    probes.ready = None
    assert get(server.port, "/readyz") == (200, b"ok\n")
    probes.live = "stalled for 200s"
    assert get(server.port, "/livez") == (503, b"stalled for 200s\n")
    assert get(server.port, "/health") == (404, b"not found\n")
    assert get(server.port, "/livez", "POST") == (405, b"GET only\n")
    probes.ready = "raise"  # a probe that raises is a 503 saying so; the server goes on
    assert get(server.port, "/readyz") == (503, b"the probe failed: boom\n")
    assert get(server.port, "/livez") == (503, b"stalled for 200s\n")


def test_head_answers_without_a_body(served: tuple[HealthServer, Probes]) -> None:
    server, _ = served
    raw = ask(server.port, b"HEAD /livez HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: 3\r\n" in raw and raw.endswith(b"\r\n\r\n")


def test_a_head_too_long_is_dropped_unanswered(served: tuple[HealthServer, Probes]) -> None:
    server, _ = served
    assert ask(server.port, b"GET /livez HTTP/1.1\r\nX: " + b"a" * (2 * MAX_HEAD_BYTES)) == b""
    assert get(server.port, "/livez") == (200, b"ok\n")


def test_a_silent_client_does_not_hold_the_server(served: tuple[HealthServer, Probes]) -> None:
    """One request at a time, each head bounded in time: a connection that sends nothing is
    dropped, and the probe behind it is answered."""
    server, _ = served
    with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S) as idle:
        assert get(server.port, "/livez") == (200, b"ok\n")
        assert idle.recv(1) == b""  # the server closed it, answering nothing


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_health_args(parser)
    return parser.parse_args(list(argv))


def test_start_health_flags() -> None:
    assert parse().health_port == 0 and parse().health_host == "127.0.0.1"
    assert start_health(parse(), lambda: None, lambda: None) is None  # port 0: no server
    with pytest.raises(SystemExit, match=r"must be in 1\.\.65535"):
        start_health(parse("--health-port=70000"), lambda: None, lambda: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot serve health probes on 127.0.0.1:{port}"):
            start_health(parse(f"--health-port={port}"), lambda: None, lambda: None)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_loop_ticks() -> None:
    clock = Clock()
    ticks = LoopTicks(stall_s=30.0, ready_s=5.0, clock=clock)
    assert (ticks.livez(), ticks.readyz()) == (None, "the loop has not come round yet")
    clock.now = 131.0  # no tick at all for longer than the stall limit
    assert ticks.livez() == "the loop has not come round for 31.0s"
    ticks.tick(131.0)
    clock.now = 135.0
    assert (ticks.livez(), ticks.readyz()) == (None, None)
    clock.now = 137.0
    assert (ticks.livez(), ticks.readyz()) == (None, "the loop has not come round for 6.0s")
    clock.now = 161.5
    assert ticks.livez() == "the loop has not come round for 30.5s"


@dataclass
class FakeWorker:
    draining: bool = False


@dataclass
class FakeLiveness:
    stalled: bool = False
    stall_timeout_s: float = 120.0


class FakeLink:
    problem: str | None = "no connection to the coordinator at tcp://c:5550 yet"


def test_worker_probes_through_its_states() -> None:
    health = WorkerHealth()
    assert (health.livez(), health.readyz()) == (None, "starting: the engine is loading")
    worker, liveness, link = FakeWorker(), FakeLiveness(), FakeLink()
    health._serving = Serving(worker, liveness, link)  # type: ignore[arg-type]
    assert health.readyz() == "no connection to the coordinator at tcp://c:5550 yet"
    link.problem = None
    assert (health.livez(), health.readyz()) == (None, None)
    liveness.stalled = True
    assert health.livez() == "stalled: the step loop has not come round for 120s"
    assert health.readyz() == "stalled: the step loop does not come round"
    liveness.stalled = False
    worker.draining = True
    assert health.livez() is None
    assert health.readyz() == "draining: finishing the work in flight, taking no more"


def test_worker_health_without_a_port_starts_nothing() -> None:
    health = WorkerHealth.start(parse())
    ctx = zmq.Context()
    try:
        health.serving(FakeWorker(), FakeLiveness(), ctx, "tcp://127.0.0.1:1")  # type: ignore[arg-type]
        assert health.server is None and health._link is None
        assert health.readyz() is None
    finally:
        health.close()
        ctx.term()


def test_link_states_from_monitor_events() -> None:
    link = CoordinatorLink(zmq.Context.instance(), "tcp://coordinator:5550")
    assert (link.up, link.problem) == (
        False,
        "no connection to the coordinator at tcp://coordinator:5550 yet",
    )
    link.on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert (link.up, link.problem) == (True, None)
    link.on_event(zmq.EVENT_DISCONNECTED)
    assert (link.up, link.problem) == (
        False,
        "disconnected from the coordinator at tcp://coordinator:5550",
    )
    link.on_event(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    refused = (False, "the coordinator at tcp://coordinator:5550 refused the handshake (keys?)")
    assert (link.up, link.problem) == refused
    link.on_event(zmq.EVENT_DISCONNECTED)  # what follows a refusal: the refusal stays the reason
    assert (link.up, link.problem) == refused
    link.on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert (link.up, link.problem) == (True, None)
