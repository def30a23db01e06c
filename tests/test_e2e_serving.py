"""End to end: ``pdserve serve`` processes, the official openai client, exact tokens."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from tests.e2e_util import LOCAL_SH, PDSERVE, ServedCluster
from tests.engine_util import greedy, hf_greedy, make_engine
from tests.gateway_util import wait_for, wait_until

PROMPTS = ["The quick brown fox", "Serving systems split prefill", "a", "Ünïcödé 数字 and 123"]


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    c = ServedCluster(tiny_dir, "--num-kv-blocks=512")
    yield c
    c.stop()


def client(c: ServedCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)


def expected_text(tiny_dir, prompt: str, n: int) -> tuple[str, list[int]]:
    tok = Tokenizer.from_dir(tiny_dir)
    ids = tok.encode(prompt)
    engine_ids = make_engine(tiny_dir).generate([ids], greedy(n))[0].new_token_ids
    assert engine_ids == hf_greedy(tiny_dir, ids, n)
    return tok.decode(engine_ids), engine_ids


def test_completions_equal_engine_and_transformers(cluster, tiny_dir) -> None:
    api = client(cluster)
    for prompt in PROMPTS:
        text, _ = expected_text(tiny_dir, prompt, 12)
        out = api.completions.create(
            model=cluster.model_name,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == text
        assert out.usage.completion_tokens == 12
        stream = api.completions.create(
            model=cluster.model_name,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_stream_equals_non_stream_and_n(cluster) -> None:
    api = client(cluster)
    messages = [{"role": "user", "content": "Tell me about disaggregation"}]
    full = api.chat.completions.create(
        model=cluster.model_name, messages=messages, max_tokens=10, temperature=0
    )
    stream = api.chat.completions.create(
        model=cluster.model_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    two = api.chat.completions.create(
        model=cluster.model_name,
        messages=messages,
        max_tokens=5,
        temperature=1.0,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 10
    assert two.choices[0].message.content != two.choices[1].message.content


def test_stop_string_cuts_text(cluster, tiny_dir) -> None:
    text, _ = expected_text(tiny_dir, PROMPTS[1], 16)
    stop = text[5:8]
    cut = text[: text.index(stop)]
    out = client(cluster).completions.create(
        model=cluster.model_name,
        prompt=PROMPTS[1],
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"


def test_errors_are_openai_bodies(cluster) -> None:
    r = httpx.post(
        f"{cluster.url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2}
    )
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(
        f"{cluster.url}/v1/completions",
        json={"model": cluster.model_name, "prompt": "x", "temperature": -1},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_32_concurrent_streams_then_every_block_free(cluster) -> None:
    async def one(api: openai.AsyncOpenAI, i: int) -> int:
        stream = await api.completions.create(
            model=cluster.model_name,
            prompt=f"request number {i}",
            max_tokens=20,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run() -> list[int]:
        api = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(api, i) for i in range(32)))

    assert asyncio.run(run()) == [20] * 32
    used = cluster.wait_blocks_free()
    assert used and set(used.values()) == {0.0}
    # the prefill worker's totals reach /metrics with its next heartbeat: every push counted
    for name in ("kv_blocks_sent", "kv_transfer_seconds_count"):
        pattern = rf'^pdserve_worker_{name}(?:_total)?\{{role="prefill",[^}}]*\}} (\S+)$'
        wait_until(
            lambda p=pattern: sum(float(v) for v in re.findall(p, cluster.metrics(), re.M)) >= 32,
            what=f"32 pushes in {name}",
        )


def step_counts(c: ServedCluster) -> dict[tuple[str, str], float]:
    """(role, kind) -> engine steps its workers ran, from /metrics."""
    name = "pdserve_worker_step_seconds_count"
    pattern = rf'^{name}\{{role="(\w+)",worker="[^"]+",kind="(\w+)"\}} (\S+)$'
    out: dict[tuple[str, str], float] = {}
    for role, kind, value in re.findall(pattern, c.metrics(), re.M):
        out[role, kind] = out.get((role, kind), 0.0) + float(value)
    return out


def settled_step_counts(c: ServedCluster, quiet_s: float = 3.0) -> dict[tuple[str, str], float]:
    """``step_counts`` once unchanged over ``quiet_s`` (three heartbeats): blocks shown free
    may come from a heartbeat sent before the last requests' steps (a loaded host ran 32
    streams between two), and the next one adds them."""
    counts = step_counts(c)
    quiet_since = time.monotonic()
    deadline = quiet_since + 60
    while time.monotonic() - quiet_since < quiet_s:
        assert time.monotonic() < deadline, f"step counts never settled: {counts}"
        time.sleep(0.2)
        now = step_counts(c)
        if now != counts:
            counts, quiet_since = now, time.monotonic()
    return counts


def test_each_workers_steps_reach_metrics(cluster) -> None:
    """One request's steps, from each worker's heartbeat through the coordinator to /metrics:
    its prompt is one prefill step on the prefill worker, its tokens 1..3 three decode steps on
    the decode worker (token 0 is the prefill's)."""
    assert set(cluster.wait_blocks_free().values()) == {0.0}
    before = settled_step_counts(cluster)  # what ran before is counted
    out = client(cluster).completions.create(
        model=cluster.model_name,
        prompt="steps on each worker",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 4
    want = dict(before)
    want["prefill", "prefill"] = before.get(("prefill", "prefill"), 0.0) + 1
    want["decode", "decode"] = before.get(("decode", "decode"), 0.0) + 3
    if not wait_for(lambda: step_counts(cluster) == want, 60):
        raise AssertionError(f"steps {step_counts(cluster)}, not {want} within 60 s")
    assert set(cluster.wait_blocks_free().values()) == {0.0}
    assert step_counts(cluster) == want  # and no more: every step of the request was counted
    assert not {k for k in want if k[0] == "prefill" and k[1] != "prefill"}  # never decodes


@pytest.fixture
def slow_cluster(small_dir):
    """The small preset: 4,000 tokens take it ~15 s here, so a stream is still going when its
    blocks show in /metrics (the tiny preset's 2,000 took 1.3 s: a stream could end first)."""
    c = ServedCluster(small_dir, "--num-kv-blocks=512")
    yield c
    c.stop()


def test_client_disconnect_frees_blocks(slow_cluster) -> None:
    cluster = slow_cluster
    body = {
        "model": cluster.model_name,
        "prompt": "keep going",
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    aborted_before = aborted_count(cluster)
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line)  # the first token: it holds blocks now
        # what it holds shows in /metrics with a worker's next heartbeat (the stream goes on)
        wait_until(lambda: any(cluster.kv_blocks_used().values()), what="the stream's blocks")
    # the client is gone: the gateway aborts, both workers free the request's blocks
    used = cluster.wait_blocks_free()
    assert set(used.values()) == {0.0}, used
    wait_until(lambda: aborted_count(cluster) >= aborted_before + 1, what="the abort counted")
    assert aborted_count(cluster) == aborted_before + 1


def aborted_count(c: ServedCluster) -> float:
    pattern = r'^pdserve_requests_total\{model="[^"]*",outcome="aborted"\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, c.metrics(), re.M))


@pytest.mark.parametrize(
    "flags",
    [
        ("--prefill=2", "--decode=2"),
        ("--prefill=2", "--decode=2", "--transfer-backend=nixl"),
        ("--mode=colocated", "--pin", "--transfer-backend=nixl"),  # zmq: test_real_model
    ],
    ids=["2P2D-zmq", "2P2D-nixl", "colocated-nixl-pinned-via-local.sh"],
)
def test_cluster_shapes_give_the_same_tokens(tiny_dir, flags) -> None:
    command = LOCAL_SH if "--mode=colocated" in flags else PDSERVE
    c = ServedCluster(tiny_dir, "--num-kv-blocks=256", *flags, command=command)
    try:
        api = client(c)
        for prompt in PROMPTS[:3]:
            text, _ = expected_text(tiny_dir, prompt, 10)
            out = api.completions.create(
                model=c.model_name,
                prompt=prompt,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].text == text
        assert set(c.wait_blocks_free().values()) == {0.0}
    finally:
        c.stop()
