"""``pdserve serve --autoscale`` end to end on the real model (SmolLM2-135M-Instruct): the
coordinator's planner sizes the pools, the gateway serves its plan on ``GET /planner``, and
serve acts on it. Under a rising stream load the decode pool grows; when the traffic turns
prompt-heavy a decode worker is drained and restarted as a prefill worker (a turn); once it
is quiet the extra prefill worker is retired by drain. Every stream ends whole, every KV
block is free at the end, and no retired worker is restarted.

The planner runs on a profile written here rather than a measurement (``PROFILE``), so its
arithmetic, not this machine's speed, decides: a decode step costs 40 ms per sequence (with
``--tpot-slo 0.45`` a worker runs 11), a prompt token 50 ms of prefill (a stream of long
prompts wants more prefill workers however slowly they arrive here); ``--ttft-slo 60`` keeps
the TTFT floor out of it. The real workers' speed only sets how long each phase lasts.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e_util import ServedCluster

HANG_S = 600.0  # only a hang takes this long
VOCAB = 49_152
PROFILE = {
    "version": 1,
    "model": "smollm2-135m-instruct",
    "device": "cpu",
    "threads": 1,
    "block_size": 16,
    "kv_blocks": 512,
    "prefill": [[16, 0.8], [2048, 102.4]],
    "decode": [[1, 0, 0.04], [16, 0, 0.64], [1, 8192, 0.04], [16, 8192, 0.64]],
}


@dataclass
class Clients:
    """Streams sent to the cluster and how each ended: ``ok`` when it ended with ``[DONE]``
    after exactly ``max_tokens`` tokens (``ignore_eos``), else what it got."""

    url: str
    model: str
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    outcomes: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stream(self, prompt_len: int, max_tokens: int) -> None:
        with self.lock:  # distinct prompts: no prefix cache shortens a prefill or a reservation
            prompt = [self.rng.randrange(100, VOCAB) for _ in range(prompt_len)]
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.outcomes.append(_outcome(f"{self.url}/v1/completions", body, max_tokens))

    def start(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args)
        t.start()
        self.threads.append(t)

    def loop(self, stop: threading.Event, prompt_len: int, max_tokens: int) -> None:
        while not stop.is_set():
            self.stream(prompt_len, max_tokens)

    def join(self) -> None:
        for t in self.threads:
            t.join(HANG_S)
            assert not t.is_alive()
        self.threads.clear()


def _outcome(url: str, body: dict, max_tokens: int) -> str:
    events: list[str] = []
    try:
        with httpx.stream("POST", url, json=body, timeout=HANG_S) as r:
            if r.status_code != 200:
                return f"status {r.status_code}: {r.read()[:300]!r}"
            pending = ""
            for text in r.iter_text():
                *lines, pending = (pending + text).split("\n")
                events += [line[6:] for line in lines if line.startswith("data: ")]
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if not events or events[-1] != "[DONE]":
        return f"no [DONE]: {events[-2:]}"
    usage = json.loads(events[-2]).get("usage") or {}
    if usage.get("completion_tokens") != max_tokens:
        return f"ended early: {events[-3:]}"
    return "ok"


def wait_for(c: ServedCluster, pattern: str) -> re.Match[str]:
    """The first line of serve's output matching ``pattern``, once there is one."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        found = re.search(pattern, c.output(), re.MULTILINE)
        if found:
            return found
        if c.proc.poll() is not None:
            break
        time.sleep(0.5)
    output = c.output()
    tail = "\n".join(story(output)) + "\n...\n" + output[-3000:]
    raise AssertionError(f"no line matches {pattern!r}:\n{tail}")


@pytest.fixture
def cluster(real_dir: Path, tmp_path: Path) -> Iterator[ServedCluster]:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE), encoding="utf-8")
    c = ServedCluster(
        real_dir,
        "--autoscale",
        "--max-workers=3",
        "--autoscale-interval=1",
        "--planner-interval=1",
        "--planner-window=8",  # a phase's load leaves the plan within 8 s
        "--scale-down-cooldown=10",  # and a lower count holds 10 s before it acts
        f"--profile={profile}",
        "--ttft-slo=60",
        "--tpot-slo=0.45",
        "--num-kv-blocks=512",
        # a drained decode worker waits for its reservations' prefills, which queue behind
        # each other on one slow prefill worker here: neither wait may give up first
        "--drain-timeout=120",
        "--transfer-timeout=120",
        ready_timeout=300,
    )
    try:
        yield c
    finally:
        c.stop()


def story(output: str) -> list[str]:
    """Serve's lines on plans, actions and workers coming and going."""
    pattern = r"^.*(?:autoscale:|planner:|registered|draining|missed).*$"
    return re.findall(pattern, output, re.MULTILINE)


def actions(output: str) -> list[str]:
    """The autoscaler's actions, the plan's reason and the drained worker's load cut off."""
    lines = re.findall(r"^pdserve serve: autoscale: (?!plan:)(.*)$", output, re.MULTILINE)
    lines = [re.sub(r" \(plan: .*\)$", "", line) for line in lines]
    return [re.sub(r", \d+ in flight\)", ")", line) for line in lines]


def test_autoscale_grows_decode_turns_a_worker_and_retires_by_drain(cluster) -> None:
    c = cluster
    clients = Clients(c.url, c.model_name)
    # 1. a rising stream load: short prompts, long answers, one more stream every half second
    for _ in range(8):
        clients.start(clients.stream, 16, 250)
        time.sleep(0.5)
    wait_for(c, r"grow decode 1 -> 2: start decode-2 in slot worker-2")
    wait_for(c, r"registered decode worker decode-2 ")
    clients.join()
    # 2. prompt-heavy: long prompts, short answers, until a decode worker turned to prefill
    stop = threading.Event()
    for _ in range(3):  # each decode worker has some in flight when one is drained
        clients.start(clients.loop, stop, 500, 8)
    turned = wait_for(c, r"turned slot (worker-\d) to prefill: start (prefill-\d+)")
    wait_for(c, rf"registered prefill worker {turned.group(2)} ")
    stop.set()
    clients.join()
    # 3. quiet: the extra prefill worker is retired by drain
    retired = wait_for(c, r"shrink prefill 2 -> 1: drain (prefill-\d+) \(slot (worker-\d),")
    wait_for(c, rf"retired {retired.group(1)} ")
    failed = [o for o in clients.outcomes if o != "ok"]
    assert clients.outcomes and not failed, (failed, "\n".join(story(c.output())))
    used = c.wait_blocks_free()
    assert set(used.values()) == {0.0}, used
    output = c.output()
    slot, prefill = turned.groups()
    decode = re.search(rf"retired (decode-\d+) \(slot {slot} free\)", output)
    assert decode is not None, output[-8000:]
    # the plan moved a worker from decode to prefill in one step (the turn drains a decode
    # worker), or in two close ones (decode shrank, and its slot, still draining, turns)
    turn = [
        f"turn decode -> prefill (prefill/decode mix changed): drain {decode[1]} (slot {slot})",
    ]
    if f"shrink decode 2 -> 1: drain {decode[1]}" in output:
        turn = [
            f"shrink decode 2 -> 1: drain {decode[1]} (slot {slot})",
            f"turn decode -> prefill: slot {slot} restarts once {decode[1]} has drained",
        ]
    assert actions(output) == [
        "grow decode 1 -> 2: start decode-2 in slot worker-2",
        *turn,
        f"retired {decode[1]} (slot {slot} free)",
        f"turned slot {slot} to prefill: start {prefill}",
        f"shrink prefill 2 -> 1: drain {retired[1]} (slot {retired[2]})",
        f"retired {retired[1]} (slot {retired[2]} free)",
    ]
    assert "restarting it" not in output, output[-8000:]  # no worker crashed, none came back
    assert "Traceback" not in output, output[-8000:]
    print("\n".join(story(output)))  # what happened and why (pytest -s)
