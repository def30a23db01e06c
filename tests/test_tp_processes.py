"""Tensor-parallel groups as real processes: ranks started apart (``pdserve tp-rank``), ranks
that disagree, and a rank killed under a live stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.engine.tokenizer import Tokenizer
from pdserve.runtime.sockets import free_port
from tests.e2e_util import ServedCluster
from tests.engine_util import greedy, make_engine
from tests.test_e2e_resilience import stream_on_a_decode_worker

PDSERVE = [sys.executable, "-m", "pdserve.launch.cli"]


def _pair(leader_model: Path, rank_model: Path) -> tuple[subprocess.Popen[str], ...]:
    """``pdserve generate`` as rank 0 of a TP-2 group meeting at a TCP rendezvous, and its
    rank 1 started apart, as on another node."""
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    group = ["--tensor-parallel-size=2", f"--tp-rendezvous={rendezvous}", "--threads=1"]
    common = ["--num-kv-blocks=64", "--dtype=float32", "--tp-timeout=20"]
    leader = subprocess.Popen(
        [
            *PDSERVE,
            "generate",
            f"--model={leader_model}",
            *group,
            *common,
            "--max-tokens=6",
            "--ignore-eos",
            "--json",
            "hello there",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rank = subprocess.Popen(
        [*PDSERVE, "tp-rank", f"--model={rank_model}", "--tp-rank=1", *group, *common],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return leader, rank


def _finish(*procs: subprocess.Popen[str]) -> list[tuple[int, str]]:
    out = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
        out.append((proc.returncode, text))
    return out


def test_a_rank_started_apart_joins_and_the_tokens_are_one_processs(small_dir: Path) -> None:
    (rc0, out0), (rc1, out1) = _finish(*_pair(small_dir, small_dir))
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    line = [x for x in out0.splitlines() if x.startswith("{")][-1]
    tok = Tokenizer.from_dir(small_dir)
    alone = make_engine(small_dir, num_blocks=64)
    want = alone.generate([tok.encode("hello there")], greedy(6))[0].new_token_ids
    assert json.loads(line)["token_ids"] == want


def test_ranks_with_other_model_files_refuse_to_start(small_dir: Path, tiny_dir: Path) -> None:
    for rc, out in _finish(*_pair(small_dir, tiny_dir)):
        assert rc != 0
        assert "disagree, refusing to start: model files (rank 0: small:" in out, out[-3000:]
        assert "rank 1: llama:" in out or "rank 1: " in out


def _children(pid: int) -> list[tuple[int, str]]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines()]
    return [(int(r[0]), r[2]) for r in rows if len(r) == 3 and int(r[1]) == pid]


def test_a_rank_killed_mid_stream_ends_its_group_with_the_reason(small_dir: Path) -> None:
    """A TP-2 decode worker: SIGKILL its rank 1 under a live stream. Rank 0 leaves at its
    next collective, within the coordinator's heartbeat timeout; the coordinator sees the
    worker gone and ends the stream with the reason (with another decode worker it would
    move: the same path as one process's death, tests/test_e2e_resilience.py); serve restarts
    the whole group, which serves again; no block stays taken."""
    c = ServedCluster(
        small_dir,
        "--prefill=1",
        "--decode=1",
        "--decode-tp=2",
        "--kv-cache-memory=256M",
        "--max-migrations=0",
    )
    try:
        body = {
            "model": c.model_name,
            "prompt": "a long story",
            "max_tokens": 1500,  # still going when the rank is killed (300 could end first)
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        t, busy = stream_on_a_decode_worker(c, body, events)
        leader = next(
            pid for pid, args in _children(c.proc.pid) if f"--worker-id={busy[0]}" in args
        )
        [rank1] = [pid for pid, args in _children(leader) if "pdserve.engine.tp.follower" in args]
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 30
        while time.monotonic() < deadline:
            try:
                os.kill(leader, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        left_after = time.monotonic() - killed
        print(f"rank 0 left {left_after:.2f} s after its rank 1 was killed")
        assert left_after < 5, f"rank 0 outlived its rank 1 by {left_after:.1f} s"
        t.join(120)
        assert not t.is_alive(), "the stream hung"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert f"worker {busy[0]} stopped responding" in error["message"], error
        assert "a collective failed" in c.output() or "is gone" in c.output()
        # serve restarts the group (rank 0 starts its rank 1 again): it registers and serves
        deadline = time.monotonic() + 90
        while c.kv_blocks_used().get(busy[0]) != 0.0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.kv_blocks_used().get(busy[0]) == 0.0, "the restarted group never reported"
        r = httpx.post(
            f"{c.url}/v1/completions",
            timeout=90,
            json={"model": c.model_name, "prompt": "still?", "max_tokens": 4, "ignore_eos": True},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert set(c.wait_blocks_free().values()) == {0.0}
    finally:
        c.stop()
