"""Across hosts: every role in its own Linux network namespace, joined by veth pairs on a
bridge, KV over that network; then one decode worker's link is cut mid-stream.

The namespaces are this test's own hosts (10.200.77.0/24 exists only inside them and on the
bridge it makes); everything is removed afterwards. Skipped, with the reason, where network
namespaces cannot be created (not root, no ``ip``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.engine_util import greedy, make_engine

SUBNET = "10.200.77"
HOSTS = {"coord": 2, "gw": 3, "pre": 4, "dec0": 5, "dec1": 6}


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check)


class Hosts:
    """A bridge in this namespace (at .1) and one namespace per role, each with a veth."""

    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.bridge = f"pdbr{self.tag}"
        self.names = {role: f"pd{role}{self.tag}" for role in HOSTS}
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for role, last in HOSTS.items():
            ns, host_end = self.names[role], f"v{role}{self.tag}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", host_end, "master", self.bridge)
            sh("ip", "link", "set", host_end, "up")
            self.run(role, "ip", "addr", "add", f"{SUBNET}.{last}/24", "dev", "eth0")
            self.run(role, "ip", "link", "set", "eth0", "up")
            self.run(role, "ip", "link", "set", "lo", "up")

    def run(self, role: str, *args: str) -> None:
        sh("ip", "netns", "exec", self.names[role], *args)

    def cmd(self, role: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[role], *args]

    def addr(self, role: str) -> str:
        return f"{SUBNET}.{HOSTS[role]}"

    def cut(self, role: str) -> None:
        sh("ip", "link", "set", f"v{role}{self.tag}", "down")

    def remove(self) -> None:
        for ns in self.names.values():
            sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", self.bridge, check=False)


@pytest.fixture
def hosts():
    """Three hosts on a bridge. The test runs as root with iproute2 (`make test` installs it;
    CI runs as root): without them it fails saying so, it never skips."""
    assert os.geteuid() == 0, "network namespaces need root: run the suite as root"
    assert shutil.which("ip"), "iproute2's `ip` is missing (make test installs iproute2)"
    try:
        h = Hosts()
    except subprocess.CalledProcessError as e:
        pytest.fail(f"cannot create network namespaces here: {e.stderr.strip()}")
    yield h
    h.remove()


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small preset: slow enough on CPU that a long stream is still going when cut."""
    from pdserve.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("small") / "small", preset="small")


def test_roles_on_separate_hosts_survive_a_cut_link(
    hosts: Hosts, small_dir: Path, tmp_path: Path
) -> None:
    pdserve = [sys.executable, "-m", "pdserve.launch.cli"]
    coordinator = f"tcp://{hosts.addr('coord')}:5550"
    common = [
        f"--model={small_dir}",
        f"--coordinator={coordinator}",
        "--threads=1",
        "--kv-cache-memory=128M",
    ]
    roles = {
        "coord": [*pdserve, "coordinator", f"--bind={coordinator}", "--heartbeat-timeout=2"],
        "pre": [
            *pdserve,
            "prefill",
            *common,
            "--worker-id=pre",
            f"--control-bind=tcp://{hosts.addr('pre')}:0",
        ],
        "dec0": [
            *pdserve,
            "decode",
            *common,
            "--worker-id=dec0",
            f"--control-bind=tcp://{hosts.addr('dec0')}:0",
            f"--transfer-bind=tcp://{hosts.addr('dec0')}:0",
        ],
        "dec1": [
            *pdserve,
            "decode",
            *common,
            "--worker-id=dec1",
            f"--control-bind=tcp://{hosts.addr('dec1')}:0",
            f"--transfer-bind=tcp://{hosts.addr('dec1')}:0",
        ],
        "gw": [
            *pdserve,
            "gateway",
            f"--coordinator={coordinator}",
            f"--host={hosts.addr('gw')}",
            "--port=8000",
            f"--stream-bind=tcp://{hosts.addr('gw')}:0",
        ],
    }
    # one CURVE identity per host, as `pdserve keygen` lays them out for several nodes
    keys = tmp_path / "keys"
    nodes = ["coord:coordinator", "pre:prefill", "dec0:decode", "dec1:decode", "gw:gateway"]
    subprocess.run([*pdserve, "keygen", f"--out={keys}", "--nodes", *nodes], check=True)
    for role, cmd in roles.items():
        cmd.append(f"--keys={keys / role}")
    cwd = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen(
            hosts.cmd(role, *cmd), cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for role, cmd in roles.items()
    ]
    url = f"http://{hosts.addr('gw')}:8000"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        model = small_dir.name
        # exact tokens with KV crossing the network between namespaces
        tok = Tokenizer.from_dir(small_dir)
        expected = make_engine(small_dir).generate([tok.encode("over the wire")], greedy(12))
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=30,
            json={
                "model": model,
                "prompt": "over the wire",
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode(expected[0].new_token_ids)

        # a long stream; cut the link of the decode worker serving it
        events: list[str] = []
        body = {
            "model": model,
            "prompt": "keep streaming",
            "max_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        }

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as s:
                events.extend(line[6:] for line in s.iter_lines() if line.startswith("data: "))

        t = threading.Thread(target=stream)
        t.start()
        serving = None
        deadline = time.monotonic() + 10
        while serving is None and time.monotonic() < deadline:
            metrics = httpx.get(f"{url}/metrics").text
            for wid in ("dec0", "dec1"):
                line = next(
                    (
                        x
                        for x in metrics.splitlines()
                        if x.startswith("pdserve_kv_blocks_used") and f'"{wid}"' in x
                    ),
                    "",
                )
                if line and float(line.split()[-1]) > 0:
                    serving = wid
            time.sleep(0.05)
        assert serving is not None, "no decode worker showed the stream"
        hosts.cut(serving)
        t.join(180)  # a hang never ends; a loaded 2-core host needs more than a minute
        assert not t.is_alive(), "the stream hung after the link was cut"
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        # the stream moved to the other decode worker (migration) and finished
        assert last["choices"][0]["finish_reason"] == "length", last
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=30,
            json={"model": model, "prompt": "still serving", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
