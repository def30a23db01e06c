"""Preemption end to end: decode caches of a few hundred tokens, many more tokens asked of
them. Every stream finishes, token for token what it is alone; constrained and ``n = 3``
streams preempted mid-way stay exact and valid; a stream whose worker then dies migrates;
every block is free at the end; a prompt no cache can hold is a 400 with the numbers."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.e2e_util import ServedCluster
from tests.engine_util import greedy, make_engine
from tests.test_e2e_resilience import pids_of, stream_events
from tests.test_structured import SCHEMA

BLOCKS, BLOCK_SIZE = 24, 16  # 384 tokens a worker
MAX_TOKENS = 150  # 16 streams of ~160 tokens: 2,600 tokens on 768


@pytest.fixture(scope="module")
def cluster(small_dir):
    c = ServedCluster(
        small_dir,
        "--prefill=1",
        "--decode=2",
        f"--num-kv-blocks={BLOCKS}",
        f"--block-size={BLOCK_SIZE}",
        "--max-migrations=3",
    )
    yield c
    c.stop()


def preemptions(c: ServedCluster) -> dict[str, float]:
    pattern = r'^pdserve_worker_preemptions_total\{[^}]*worker="([^"]+)"[^}]*\} (\S+)$'
    return {w: float(v) for w, v in re.findall(pattern, c.metrics(), re.MULTILINE)}


def completion(c: ServedCluster, body: dict) -> dict:
    r = httpx.post(f"{c.url}/v1/completions", json={"model": c.model_name, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_sixteen_streams_on_small_caches_each_equal_alone(cluster, small_dir) -> None:
    tok = Tokenizer.from_dir(small_dir)
    texts = [f"story {i}: " + "once upon a time " * (i % 4 + 1) for i in range(16)]
    plain = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    bodies = [{"prompt": t, **plain} for t in texts]
    schema = {
        "prompt": "a person as JSON:",
        "max_tokens": 120,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    }
    three = {"prompt": "three ways:", "max_tokens": 120, "n": 3, "seed": 7, "ignore_eos": True}
    with ThreadPoolExecutor(18) as pool:
        outs = list(pool.map(lambda b: completion(cluster, b), [*bodies, schema, three]))
    engine = make_engine(small_dir, block_size=BLOCK_SIZE, num_blocks=512)
    for text, out in zip(texts, outs, strict=False):
        ids = tok.encode(text)
        [want] = engine.generate([ids], greedy(MAX_TOKENS))
        assert out["choices"][0]["text"] == tok.decode(want.new_token_ids), text
        assert out["usage"]["completion_tokens"] == MAX_TOKENS
    assert sum(preemptions(cluster).values()) > 0
    constrained, sampled = outs[16]["choices"], outs[17]["choices"]
    assert constrained[0]["finish_reason"] == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads(constrained[0]["text"]))  # held across
    assert [c["index"] for c in sampled] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in sampled)
    assert outs[17]["usage"]["completion_tokens"] == 3 * 120
    # alone on an idle cluster (nothing preempted), each says the same, token for token
    assert completion(cluster, schema)["choices"] == constrained
    assert completion(cluster, three)["choices"] == sampled
    assert set(cluster.wait_blocks_free().values()) == {0.0}


def test_a_prompt_no_cache_holds_is_a_400_with_the_numbers(cluster) -> None:
    body = {"model": cluster.model_name, "prompt": list(range(5, 405)), "max_tokens": 1}
    r = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "the prompt (400 tokens, 1 choice(s)) needs 416 tokens of KV cache" in message
    assert "more than the 384 the largest decode worker holds" in message


def test_a_preempted_stream_whose_worker_dies_migrates(cluster, small_dir) -> None:
    tok = Tokenizer.from_dir(small_dir)
    before = preemptions(cluster)
    long = {"prompt": "a long tale", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    body = {"model": cluster.model_name, **long, "stream": True}
    events: list[str] = []
    started = threading.Event()
    watched = threading.Thread(target=stream_events, args=(cluster.url, body, events, started))
    watched.start()
    assert started.wait(60)
    crowd = {**long, "max_tokens": 200}
    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(completion, cluster, crowd) for _ in range(8)]
        deadline = time.monotonic() + 120
        grown = {}
        while not grown and time.monotonic() < deadline:
            grown = {w for w, n in preemptions(cluster).items() if n > before.get(w, 0)}
            time.sleep(0.05)
        assert grown, "no decode worker preempted"
        victim = sorted(grown)[0]
        [pid] = pids_of(victim, cluster.proc.pid)
        os.kill(pid, signal.SIGKILL)
        watched.join(240)
        assert not watched.is_alive(), "the stream hung"
        texts = [f.result()["choices"][0]["text"] for f in others]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    engine = make_engine(small_dir, block_size=BLOCK_SIZE, num_blocks=512)
    [want] = engine.generate([tok.encode("a long tale")], greedy(300))
    assert text == tok.decode(want.new_token_ids)
    # the same prompt: every other stream (those on the dead worker moved) says its first 200
    assert texts == [tok.decode(want.new_token_ids[:200])] * 8
    assert set(cluster.wait_blocks_free().values()) == {0.0}
