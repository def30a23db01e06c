"""Graceful drain of a real ``pdserve gateway`` process on SIGTERM, in front of ``FakeCluster``
(a test double for the coordinator and its workers) that streams scripted tokens, holding all
but the first until the test lets them go."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol import messages as m
from tests.gateway_util import (
    ClusterScript,
    FakeCluster,
    chunk,
    served_model,
    wait_for,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
TEXT = " one two three four five six seven eight nine ten"


class GatewayProcess:
    """``python -m launch.cli gateway`` on a free port; its output is collected as it comes."""

    def __init__(self, coordinator: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "pdserve.launch.cli", "gateway", "--coordinator", coordinator,
               "--port", "0", *extra]  # fmt: skip
        # the coordinator here is a plain-socket test double: no CURVE keys
        env = {**os.environ, "PDSERVE_INSECURE": "1"}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        prefix = "pdserve gateway: "
        if not wait_for(lambda: any(x.startswith(prefix) for x in self.lines), timeout=120):
            self.proc.kill()
            raise RuntimeError("the gateway did not start:\n" + self.output)
        self.url = next(x for x in self.lines if x.startswith(prefix))[len(prefix) :].strip()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float = 60) -> int:
        """The exit code, once the process has ended and all it printed is in ``output``."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


def held(ids: list[int], release: threading.Event | None = None) -> ClusterScript:
    """Token 0 at once from the prefill worker; once ``release`` is set, the others from the
    decode worker, one a chunk, the last finishing the choice (no ``release``: none ever)."""

    def respond(g: m.Generate) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = [("prefill", chunk(g, 0, 0, ids[:1]))]
        if release is None:
            return out
        out.append(("wait", release))
        for i in range(1, len(ids)):
            reason = "stop" if i == len(ids) - 1 else None
            out.append(("decode", chunk(g, 0, i, ids[i : i + 1], finish_reason=reason)))
        return out

    return respond


@pytest.fixture
def ids(tiny_dir: Path) -> list[int]:
    tok = Tokenizer.from_dir(tiny_dir)
    return [*tok.encode(TEXT, add_special_tokens=False), tok.eos_token_ids[0]]


@pytest.fixture
def cluster(tiny_dir: Path) -> Iterator[FakeCluster]:
    fake = FakeCluster(lambda g: [])
    models = [served_model("tiny", 256, root=str(tiny_dir))]
    fake.state = m.ClusterState(models=models, workers=[])
    yield fake
    fake.close()


def started(cluster: FakeCluster, *extra: str) -> GatewayProcess:
    gateway = GatewayProcess(cluster.address, *extra)
    healthy = wait_for(lambda: httpx.get(f"{gateway.url}/health").status_code == 200)
    assert healthy, gateway.output
    return gateway


def read_events(lines: Iterator[str]) -> list[Any]:
    return [x[6:] if x == "data: [DONE]" else json.loads(x[6:]) for x in lines if x]


def test_sigterm_lets_the_stream_finish_and_refuses_new_requests(
    cluster: FakeCluster, ids: list[int], tiny_dir: Path
) -> None:
    release = threading.Event()  # the rest of the stream waits for the checks below
    cluster.respond = held(ids, release)
    gateway = started(cluster, "--drain-timeout", "600")
    url = gateway.url
    try:
        body = {"model": "tiny", "prompt": "Hi", "stream": True, "max_tokens": 32}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = read_events(iter([next(x for x in lines if x)]))
            gateway.proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 503)
            health = httpx.get(f"{url}/health").json()
            assert health["error"]["message"] == "draining"
            refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"] == {
                "message": "The server is draining: it takes no new requests.",
                "type": "server_error",
                "param": None,
                "code": "service_unavailable",
            }
            assert gateway.proc.poll() is None  # still serving the stream
            release.set()
            rest = read_events(lines)
        events = first + rest
        assert events[-1] == "[DONE]"
        tok = Tokenizer.from_dir(tiny_dir)
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == tok.decode(ids[:-1])
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert gateway.wait() == 0
        assert len(cluster.generates) == 1  # the refused request never reached the cluster
        assert cluster.aborts == []
        assert "drained: no request in flight; shutting down" in gateway.output
    finally:
        gateway.stop()


def test_drain_timeout_ends_the_stream_with_an_error(cluster: FakeCluster, ids: list[int]) -> None:
    cluster.respond = held(ids)  # token 0, then nothing
    gateway = started(cluster, "--drain-timeout", "1")
    try:
        body = {"model": "tiny", "prompt": "Hi", "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(x for x in lines if x)
            gateway.proc.send_signal(signal.SIGTERM)
            rest = read_events(lines)
        assert rest == [
            {"error": {"message": "The server shut down before the request finished.",
                       "type": "server_error", "param": None, "code": "service_unavailable"}},
            "[DONE]",
        ]  # fmt: skip
        assert gateway.wait() == 0
        # what ended the stream: the drain timeout, as the gateway logs it (only once the
        # deadline has passed: not before it), after the drain began; and the expired stream
        # left within its grace
        out = gateway.output
        began = "draining 1 request(s) in flight, for at most 1 s"
        expired = "drain timeout: ending 1 generation(s) of 1 request(s) in flight"
        assert began in out and expired in out, out
        assert out.index(began) < out.index(expired)
        assert "still in flight; shutting down" not in out, out
        wait_until(lambda: len(cluster.aborts) == 1, what="the abort at the cluster")
        assert cluster.aborts == [m.Abort(cluster.generates[0].request_id, "gateway")]
    finally:
        gateway.stop()


def test_idle_gateway_exits_0_at_once(cluster: FakeCluster) -> None:
    # a drain timeout far past the wait below: only an idle gateway's own choice ends it in time
    gateway = started(cluster, "--drain-timeout", "600")
    try:
        gateway.proc.send_signal(signal.SIGTERM)
        assert gateway.wait() == 0
        assert "drained: no request in flight; shutting down" in gateway.output, gateway.output
    finally:
        gateway.stop()
