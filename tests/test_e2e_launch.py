"""The per-role launch scripts start a cluster serving two models; each answers by name."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.runtime.sockets import free_port

LAUNCH = Path(__file__).resolve().parents[1] / "launch"


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in started:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def test_role_scripts_serve_two_models(tiny_dir, model_dirs, procs, tmp_path) -> None:
    coordinator = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    # the cluster's keys, as for several nodes: every role here runs as node "a"
    keygen = [sys.executable, "-m", "pdserve.launch.cli", "keygen", f"--out={tmp_path / 'keys'}"]
    subprocess.run([*keygen, "--nodes", "a:all", "b:decode"], check=True)
    env = {
        **os.environ,
        "PDSERVE_COORDINATOR_BIND": coordinator,
        "PDSERVE_COORDINATOR": coordinator,
        "PDSERVE_KEYS": str(tmp_path / "keys" / "a"),
    }
    common = ["--num-kv-blocks=128", "--threads=1"]

    def start(script: str, *args: str) -> None:
        procs.append(subprocess.Popen(["bash", str(LAUNCH / script), *args], env=env))

    start("coordinator.sh")
    start("prefill.sh", f"--model={tiny_dir}", "--served-model-name=alpha", *common)
    start("decode.sh", f"--model={tiny_dir}", "--served-model-name=alpha", *common)
    start(
        "decode.sh",
        f"--model={model_dirs['qwen3']}",
        "--served-model-name=beta",
        "--colocated",
        *common,
    )
    start("gateway.sh", f"--port={port}")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    names: list[str] = []
    while time.monotonic() < deadline and names != ["alpha", "beta"]:
        assert all(p.poll() is None for p in procs), "a role exited during start-up"
        with contextlib.suppress(httpx.HTTPError):
            names = sorted(m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"])
        time.sleep(0.3)
    assert names == ["alpha", "beta"]
    for model in names:
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=30,
            json={
                "model": model,
                "prompt": "hello",
                "max_tokens": 5,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
    r = httpx.post(f"{url}/v1/completions", json={"model": "gamma", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # each script execs its role, whose command line names it (operators find and signal
    # it by that): read the command lines of the very processes started here
    roles = ("coordinator", "prefill", "decode", "decode", "gateway")
    for proc, role in zip(procs, roles, strict=True):
        assert proc.poll() is None, f"{role} exited"
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        at = next(i for i, a in enumerate(argv) if a.endswith(b"/pdserve"))  # the console script
        assert argv[at + 1] == role.encode(), argv
