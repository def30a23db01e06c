"""``--health-port`` on real processes: a coordinator and decode workers on loopback, probed as
a kubelet would (runtime/health_http.py). A worker is ready once the coordinator admitted its
key, never with another cluster's key, and not once the coordinator is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.runtime.sockets import free_port

PDSERVE = [sys.executable, "-m", "pdserve.launch.cli"]
START_S = 120.0  # only a role that never gets there takes this long


def probe(port: int, path: str) -> tuple[int, str]:
    """(status, body) of one probe; (0, why) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return 0, str(e)


def wait_for(port: int, path: str, want: int, text: str = "") -> tuple[int, str]:
    """Probe until it answers ``want`` with ``text`` in its body (or ``START_S`` passed)."""
    deadline = time.monotonic() + START_S
    got = probe(port, path)
    while not (got[0] == want and text in got[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
        got = probe(port, path)
    return got


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "ab") as log:  # a file: nobody reads a pipe
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            for var in ("PDSERVE_COORDINATOR", "PDSERVE_KEYS", "PDSERVE_KEY_NAME"):
                env.pop(var, None)
            proc = subprocess.Popen([*PDSERVE, *argv], stdout=log, stderr=log, env=env)
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    for proc in p.started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in p.started:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def keygen(out: Path, *nodes: str) -> None:
    subprocess.run([*PDSERVE, "keygen", f"--out={out}", "--nodes", *nodes], check=True)


def test_coordinator_and_workers_probed(tiny_dir: Path, procs: Procs, tmp_path: Path) -> None:
    keygen(tmp_path / "keys", "coord:coordinator", "dec:decode")
    keygen(tmp_path / "other", "coord:coordinator", "dec:decode")  # another cluster's keys
    address = f"tcp://127.0.0.1:{free_port()}"
    c_port, d_port, x_port = free_port(), free_port(), free_port()
    coordinator = procs.start(
        "coordinator",
        "coordinator",
        f"--bind={address}",
        f"--health-port={c_port}",
        f"--keys={tmp_path / 'keys' / 'coord'}",
    )
    assert wait_for(c_port, "/readyz", 200) == (200, "ok\n"), procs.log("coordinator")
    assert probe(c_port, "/livez") == (200, "ok\n")
    assert probe(c_port, "/nothing") == (404, "not found\n")

    engine = [f"--model={tiny_dir}", "--num-kv-blocks=64", "--threads=1", "--max-step-time=0"]
    worker = [f"--coordinator={address}", *engine]
    ours = procs.start(
        "decode",
        "decode",
        *worker,
        f"--health-port={d_port}",
        f"--keys={tmp_path / 'keys' / 'dec'}",
    )
    stranger = procs.start(
        "stranger",
        "decode",
        *worker,
        f"--health-port={x_port}",
        f"--keys={tmp_path / 'other' / 'dec'}",
    )
    assert wait_for(d_port, "/readyz", 200) == (200, "ok\n"), procs.log("decode")
    assert probe(d_port, "/livez") == (200, "ok\n")
    # the stranger's engine runs, but the coordinator never admits its key
    refused = f"the coordinator at {address} refused the handshake (keys?)\n"
    assert wait_for(x_port, "/readyz", 503, "refused") == (503, refused), procs.log("stranger")
    assert probe(x_port, "/livez") == (200, "ok\n")
    assert "refused this worker's connection" in procs.log("stranger")

    coordinator.send_signal(signal.SIGTERM)
    assert coordinator.wait(30) == 0
    gone = f"disconnected from the coordinator at {address}\n"
    assert wait_for(d_port, "/readyz", 503, "disconnected") == (503, gone), procs.log("decode")
    assert probe(d_port, "/livez") == (200, "ok\n")  # alive: it waits for the coordinator
    for proc in (ours, stranger):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
