"""NIXL through real processes: kill -9 either side while a transfer is under way (held open by
an injected delay, so the kill lands inside it): no stream hangs, every block comes back, and
the restarted worker's new agent is introduced to its peer (the next request's KV moves, its
greedy tokens transformers'). Prompts span several chunks; with ``--kv-stream-chunks`` the
transfer goes in parts as they complete, and the kill lands mid-stream."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.e2e_util import ServedCluster
from tests.engine_util import hf_greedy
from tests.gateway_util import wait_until
from tests.test_e2e_resilience import pids_of, stream_events


@pytest.mark.parametrize(
    ("dead", "stream"),
    [("prefill", False), ("decode", False), ("decode", True)],
    ids=["prefill", "decode", "decode-kv-stream-chunks"],
)
def test_a_side_killed_mid_transfer(tiny_dir, dead: str, stream: bool) -> None:
    c = ServedCluster(
        tiny_dir,
        "--prefill=1",
        "--decode=1",
        "--transfer-backend=nixl",
        "--kv-fault=delay:1:4",  # every offer leaves 4 s late: the transfer is open that long
        "--num-kv-blocks=256",
        "--max-num-batched-tokens=32",  # chunks of 2 blocks: the prompts take several
        *(["--kv-stream-chunks"] if stream else []),
    )
    try:
        body = {
            "model": c.model_name,
            "prompt": "a story " * 40,
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        started = threading.Event()
        t = threading.Thread(target=stream_events, args=(c.url, body, events, started))
        t.start()
        assert started.wait(60), "no first token"  # token 0 came from the prefill worker
        # both sides hold the request's blocks: the prefill worker its prompt's (leased to the
        # reader), the decode worker the reservation the offer is for
        wait_until(
            lambda: len([w for w, used in c.kv_blocks_used().items() if used]) == 2,
            what="blocks held on both sides of the transfer",
        )
        [victim] = [w for w in c.kv_blocks_used() if w.startswith(dead)]
        [pid] = pids_of(victim, c.proc.pid)
        os.kill(pid, signal.SIGKILL)
        t.join(180)
        assert not t.is_alive(), "the stream hung"
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            # the coordinator saw the worker die and ended the stream: with that error, or (the
            # decode worker's death) when moving the stream found no decode worker back within
            # the coordinator's --hold-timeout
            reasons = (f"worker {victim} stopped responding", "had no worker to take it for")
            assert any(r in last["error"]["message"] for r in reasons), last
        else:  # or its work moved to the restarted worker and the stream ran to its end
            assert last["choices"][0]["finish_reason"] == "length", last
            assert not any("error" in json.loads(e) for e in events[:-1])
        # serve restarts the dead worker; its new agent reaches its peer, and KV moves again
        wait_until(lambda: c.kv_blocks_used().get(victim) == 0.0, what="the restart")
        r = httpx.post(
            f"{c.url}/v1/completions",
            timeout=120,
            json={**body, "stream": False, "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        tok = Tokenizer.from_dir(tiny_dir)
        assert r.json()["choices"][0]["text"] == tok.decode(
            hf_greedy(tiny_dir, tok.encode(body["prompt"]), 8)
        )
        assert set(c.wait_blocks_free().values()) == {0.0}
        assert "nixl: loaded peer" in c.output()
        assert ("KV is offered chunk by chunk" in c.output()) is stream
    finally:
        c.stop()
