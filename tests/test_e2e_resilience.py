"""Real processes, real signals: kill -9 a decode worker mid-stream, SIGTERM the cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e_util import ServedCluster
from tests.gateway_util import wait_for, wait_until


def pids_of(worker_id: str, parent: int) -> list[int]:
    """The role processes `pdserve serve` (pid ``parent``) started for ``worker_id``."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
    return [
        int(line.split()[0])
        for line in out.stdout.splitlines()
        if int(line.split()[1]) == parent and f"--worker-id={worker_id}" in line
    ]


def stream_on_a_decode_worker(
    c: ServedCluster, body: dict, events: list[str]
) -> tuple[threading.Thread, list[str]]:
    """Start streaming ``body`` into ``events``; the thread, and the decode worker(s) whose
    blocks show the stream."""
    started = threading.Event()
    t = threading.Thread(target=stream_events, args=(c.url, body, events, started))
    t.start()
    assert started.wait(30)
    # blocks show with the workers' next heartbeats; the bound only catches "never" (5 s was
    # outrun on a loaded 2-core host while the 1,500-token stream still held its blocks)
    deadline = time.monotonic() + 60
    busy: list[str] = []
    while not busy and time.monotonic() < deadline:
        busy = [w for w, used in c.kv_blocks_used().items() if w.startswith("decode") and used]
        time.sleep(0.1)
    assert busy, "no decode worker showed the stream's blocks"
    return t, busy


def stream_events(url: str, body: dict, events: list, started: threading.Event) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()


@pytest.mark.parametrize("migrations", [0, 3], ids=["no-migration", "migration"])
def test_decode_worker_killed_mid_stream(small_dir, migrations: int) -> None:
    c = ServedCluster(
        small_dir,
        "--prefill=1",
        "--decode=2",
        "--kv-cache-memory=256M",
        f"--max-migrations={migrations}",
    )
    try:
        body = {
            "model": c.model_name,
            "prompt": "a long story",
            "max_tokens": 800,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        t, busy = stream_on_a_decode_worker(c, body, events)
        [pid] = pids_of(busy[0], c.proc.pid)
        os.kill(pid, signal.SIGKILL)
        # a hang never ends: the bound only has to outlast 1,500 tokens on a loaded 2-core host
        t.join(180)
        assert not t.is_alive(), "the stream hung"
        assert events[-1] == "[DONE]"
        if migrations:
            # the stream moved to the other decode worker and went on to the end
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "length", last
            assert not any("error" in json.loads(e) for e in events[:-1])
        else:
            # the stream ended with an error event, then [DONE]: the death of its worker's, as
            # the coordinator saw it (not a timeout, nor the end of the stream)
            error = json.loads(events[-2])["error"]
            assert f"worker {busy[0]} stopped responding" in error["message"], error
        # new requests keep succeeding on the rest of the cluster
        r = httpx.post(
            f"{c.url}/v1/completions",
            timeout=30,
            json={
                "model": c.model_name,
                "prompt": "still there?",
                "max_tokens": 4,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # serve restarts the dead worker: it registers again (its stale figures give way to
        # the new process's) and takes new work
        dead = busy[0]
        deadline = time.monotonic() + 60
        while c.kv_blocks_used().get(dead) != 0.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.kv_blocks_used().get(dead) == 0.0, "the restarted worker never reported"
        # rounds of 4 requests at once until the new process has run a step of its own
        steps = c.worker_steps().get(dead, 0.0)
        url = f"{c.url}/v1/completions"

        def complete(i: int) -> int:
            short = {**body, "prompt": f"request {i}", "max_tokens": 16, "stream": False}
            return httpx.post(url, json=short, timeout=60).status_code

        for _ in range(10):
            with ThreadPoolExecutor(4) as pool:
                codes = list(pool.map(complete, range(4)))
            assert codes == [200] * 4, codes
            if wait_for(lambda: c.worker_steps().get(dead, 0.0) > steps, 3):
                break
        else:
            raise AssertionError(f"the restarted worker got no traffic:\n{c.output()[-6000:]}")
        assert set(c.wait_blocks_free().values()) == {0.0}
    finally:
        c.stop()


def test_sigterm_drains_streams_in_flight(tiny_dir) -> None:
    c = ServedCluster(tiny_dir, "--num-kv-blocks=512", "--drain-timeout=30")
    events: list[str] = []
    started = threading.Event()
    body = {
        "model": c.model_name,
        "prompt": "finish me",
        "max_tokens": 1500,  # ~1 s of tiny's decoding: still going when the signal comes
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t = threading.Thread(target=stream_events, args=(c.url, body, events, started))
    t.start()
    assert started.wait(30)
    c.proc.send_signal(signal.SIGTERM)
    t.join(180)  # a hang bound only
    assert not t.is_alive()
    output = c.stop()
    # the stream was in flight when the signal came, and the drain waited for it
    assert "SIGTERM: draining 1 request(s) in flight" in output, output
    assert "drained: no request in flight; shutting down" in output, output
    assert "drain timeout" not in output, output
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 1500, output
    assert c.proc.returncode == 0, output
    assert not re.search(r"Traceback", output), output


def test_200_clients_giving_up_then_a_request_completes(tiny_dir) -> None:
    """The field's standard check: 200 streams abandoned after 0.5 s, then service as usual."""
    import asyncio

    c = ServedCluster(tiny_dir, "--num-kv-blocks=2048")
    try:
        body = {
            "model": c.model_name,
            "prompt": "give up on me",
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }

        async def impatient(client: httpx.AsyncClient) -> None:
            try:
                async with asyncio.timeout(0.5):
                    async with client.stream("POST", f"{c.url}/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
            except TimeoutError:
                pass

        async def crowd() -> None:
            limits = httpx.Limits(max_connections=250)
            async with httpx.AsyncClient(timeout=30, limits=limits) as client:
                await asyncio.gather(*(impatient(client) for _ in range(200)))

        asyncio.run(crowd())
        # the gateway lets go of every abandoned stream (and aborts it on the cluster)...
        deadline = time.monotonic() + 30
        while c.gateway_in_flight() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.gateway_in_flight() == 0, c.output()[-6000:]
        # ...and serves as usual meanwhile
        last = {"model": c.model_name, "prompt": "and now?", "max_tokens": 8, "ignore_eos": True}
        try:
            r = httpx.post(f"{c.url}/v1/completions", timeout=30, json=last)
        except httpx.TimeoutException as e:
            raise AssertionError(f"no answer in 30 s:\n{c.output()[-6000:]}") from e
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        # the workers let go of the crowd too: no block held
        assert set(c.wait_blocks_free().values()) == {0.0}, c.output()[-6000:]
    finally:
        c.stop()


def test_coordinator_restart_is_transparent(tiny_dir) -> None:
    c = ServedCluster(tiny_dir, "--num-kv-blocks=256")
    try:
        [(pid, _)] = [p for p in _children(c.proc.pid) if " coordinator " in p[1]]
        os.kill(pid, signal.SIGKILL)
        # serve restarts it on the same address; workers and the gateway find it again
        deadline = time.monotonic() + 180  # a hang bound only
        status = None
        while time.monotonic() < deadline and status != 200:
            try:
                status = httpx.post(
                    f"{c.url}/v1/completions",
                    timeout=60,
                    json={"model": c.model_name, "prompt": "hello again", "max_tokens": 4},
                ).status_code
            except httpx.HTTPError:
                status = None
            time.sleep(0.5)
        assert status == 200, c.stop()
    finally:
        c.stop()


def _children(parent: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines()]
    return [(int(pid), args) for pid, ppid, args in rows if int(ppid) == parent]


def test_the_only_prefill_worker_killed_under_load_fails_no_request(tiny_dir) -> None:
    """Its decode worker prefills what the dead one had (and, once the coordinator sees it
    gone, every new request) until serve has restarted it: no request fails."""
    c = ServedCluster(tiny_dir, "--prefill=1", "--decode=1", "--num-kv-blocks=1024")
    statuses: list[int] = []
    stop = threading.Event()

    def client(i: int) -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                body = {
                    "model": c.model_name,
                    "prompt": f"client {i} asks {len(statuses)}",
                    "max_tokens": 16,
                    "ignore_eos": True,
                }
                statuses.append(http.post(f"{c.url}/v1/completions", json=body).status_code)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    try:
        for t in clients:
            t.start()
        time.sleep(1.0)
        [pid] = pids_of("prefill-0", c.proc.pid)
        os.kill(pid, signal.SIGKILL)
        # past the heartbeat timeout (5 s) and the restart: both ways the death shows
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and pids_of("prefill-0", c.proc.pid) in ([], [pid]):
            time.sleep(0.2)
        time.sleep(6.0)
        stop.set()
        for t in clients:
            t.join(120)  # a hang bound only
        assert not any(t.is_alive() for t in clients), "a client hung"
        failed = [s for s in statuses if s != 200]
        assert statuses and failed == [], (len(statuses), failed, c.output()[-6000:])
        assert set(c.wait_blocks_free().values()) == {0.0}
    finally:
        stop.set()
        c.stop()


def model_states(c: ServedCluster) -> dict[str, str]:
    """model -> the state ``/metrics`` shows it in (``pdserve_model_state``)."""
    pattern = r'^pdserve_model_state\{model="([^"]+)",state="(\w+)"\} 1(?:\.0)?$'
    return dict(re.findall(pattern, c.metrics(), re.MULTILINE))


def test_a_model_without_a_live_prefill_worker_shows_degraded(tiny_dir) -> None:
    """SIGSTOP the only prefill worker: its heartbeats stop, the coordinator takes it for dead
    (serve sees a live process: no restart), and /metrics shows the model ``no_prefill`` while
    its decode worker prefills; SIGCONT, and it registers again: ``ready``."""
    c = ServedCluster(tiny_dir, "--num-kv-blocks=256")
    try:
        assert model_states(c) == {c.model_name: "ready"}
        [pid] = pids_of("prefill-0", c.proc.pid)
        os.kill(pid, signal.SIGSTOP)
        try:
            degraded = {c.model_name: "no_prefill"}
            wait_until(lambda: model_states(c) == degraded, 60, "the model shown no_prefill")
            body = {"model": c.model_name, "prompt": "still served?", "max_tokens": 4}
            r = httpx.post(f"{c.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: model_states(c) == {c.model_name: "ready"}, 60, "the model ready again")
        assert set(c.wait_blocks_free().values()) == {0.0}
    finally:
        c.stop()
