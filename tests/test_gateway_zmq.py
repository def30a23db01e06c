"""The gateway's ZMQ backend over real loopback sockets, behind the real app and uvicorn, with
``FakeCluster`` (``tests.gateway_util``) as the coordinator and its workers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import openai
import pytest
import uvicorn
import zmq
from fastapi import FastAPI

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.backend import BackendError
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.main import COORDINATOR_ENV, add_gateway_args, gateway_app, http_socket
from pdserve.gateway.token_streams import check_finish
from pdserve.gateway.zmq_backend import ZmqBackend
from pdserve.protocol import messages as m
from pdserve.protocol.checks import ProtocolError
from pdserve.protocol.codec import decode, encode
from pdserve.protocol.control import WorkerLoad
from pdserve.runtime.sockets import make_socket
from tests.gateway_util import (
    ClusterScript,
    FakeCluster,
    abandoned_post,
    chunk,
    generate,
    parse_prometheus,
    served_model,
    wait_for,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["Hello world", "Bye now"]  # choice c generates TEXTS[c % 2], then the eos
WORKERS = [
    m.WorkerStatus(
        role="prefill",
        worker_id="p0",
        model="tiny",
        load=WorkerLoad(
            free_blocks=61,
            used_blocks=3,
            total_blocks=64,
            running=1,
            waiting=2,
            queued_prompt_tokens=0,
        ),
    ),
    m.WorkerStatus(
        role="decode",
        worker_id="d0",
        model="tiny",
        load=WorkerLoad(
            free_blocks=118,
            used_blocks=10,
            total_blocks=128,
            running=2,
            waiting=0,
            queued_prompt_tokens=0,
        ),
    ),
]


def scripted(outputs: list[list[int]]) -> ClusterScript:
    """Choice c plays ``outputs[c % len]`` (its last id is the eos): the decode worker sends
    tokens 1.. two at a time, then, a little later, the prefill worker sends token 0."""

    def respond(g: m.Generate) -> list[tuple[str, Any]]:
        decode_part: list[tuple[str, Any]] = []
        prefill_part: list[tuple[str, Any]] = []
        for c in range(g.n):
            ids = outputs[c % len(outputs)]
            prefill_part.append(("prefill", chunk(g, c, 0, ids[:1])))
            for i in range(1, len(ids), 2):
                reason = "stop" if i + 2 >= len(ids) else None
                decode_part.append(("decode", chunk(g, c, i, ids[i : i + 2], finish_reason=reason)))
        return [*decode_part, ("sleep", 0.05), *prefill_part]

    return respond


def died(g: m.Generate, status: int) -> m.RequestError:
    """The request's error once token 0 is out: its decode worker died."""
    return m.RequestError(request_id=g.request_id, status=status, message="decode worker d0 died")


def state_for(tiny_dir: Path, tmp_path: Path) -> m.ClusterState:
    models = [
        served_model("tiny", 256, root=str(tiny_dir)),
        served_model("broken", 64, root=str(tmp_path / "no-model")),
        m.ServedModel(name="warming", root=str(tiny_dir), max_model_len=256, ready=False),
    ]
    return m.ClusterState(models=models, workers=WORKERS)


@contextlib.contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """uvicorn with the app's lifespan (which starts the backend) on a free loopback port."""
    sock = http_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        if not wait_for(lambda: server.started or not thread.is_alive()):
            raise RuntimeError("uvicorn did not start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


@pytest.fixture
def outputs(tok: Tokenizer) -> list[list[int]]:
    eos = tok.eos_token_ids[0]
    return [[*tok.encode(t, add_special_tokens=False), eos] for t in TEXTS]


@pytest.fixture
def cluster(outputs: list[list[int]]) -> Iterator[FakeCluster]:
    fake = FakeCluster(scripted(outputs))
    yield fake
    fake.close()


# How long the gateway trusts its last ClusterState: far longer than a loaded machine can keep it
# waiting for the next (hellos go out every 20 ms), so only a test that silences the fake
# coordinator on purpose ever sees it stale; those use SILENT_S and wait for the effect.
STATE_TIMEOUT_S = 60.0
SILENT_S = 0.5


@contextlib.contextmanager
def zmq_gateway(
    cluster: FakeCluster,
    state_timeout_s: float = STATE_TIMEOUT_S,
    config: GatewayConfig | None = None,
) -> Iterator[tuple[str, ZmqBackend]]:
    backend = ZmqBackend(cluster.address, hello_interval_s=0.02, state_timeout_s=state_timeout_s)
    app = gateway_app(backend) if config is None else gateway_app(backend, config)
    with serving(app) as url:
        yield url, backend


@pytest.fixture
def gateway(cluster: FakeCluster) -> Iterator[tuple[str, ZmqBackend]]:
    with zmq_gateway(cluster) as served:
        yield served


@pytest.fixture
def url(
    gateway: tuple[str, ZmqBackend], cluster: FakeCluster, tiny_dir: Path, tmp_path: Path
) -> str:
    """A gateway whose fake cluster answers hellos; healthy."""
    cluster.state = state_for(tiny_dir, tmp_path)
    assert wait_for(lambda: httpx.get(f"{gateway[0]}/health").status_code == 200)
    return gateway[0]


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai_client(url)


def test_health_follows_cluster_state(cluster: FakeCluster, tiny_dir: Path, tmp_path: Path) -> None:
    with zmq_gateway(cluster, state_timeout_s=SILENT_S) as (url, backend):
        assert wait_for(lambda: len(cluster.hellos) >= 2)
        assert cluster.hellos[0] == m.GatewayHello(backend.stream_address)
        response = httpx.get(f"{url}/health")
        assert (response.status_code, response.json()["error"]["code"]) == (
            503, "service_unavailable",
        )  # fmt: skip
        assert httpx.get(f"{url}/v1/models").json() == {"object": "list", "data": []}
        cluster.state = state_for(tiny_dir, tmp_path)
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
        cluster.state = None  # the coordinator falls silent: stale after state_timeout_s
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 503)


def test_models_lists_ready_models_with_a_tokenizer(
    url: str, client: openai.OpenAI, tiny_dir: Path, tmp_path: Path
) -> None:
    assert httpx.get(f"{url}/v1/models").json() == {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "pdserve",
                  "root": str(tiny_dir), "parent": None, "max_model_len": 256}],
    }  # fmt: skip
    with pytest.raises(openai.APIStatusError) as broken:
        client.completions.create(model="broken", prompt="Hi")
    assert broken.value.status_code == 503
    message = broken.value.response.json()["error"]["message"]
    assert message.startswith(f"model `broken` is unavailable: no tokenizer in {tmp_path}")
    with pytest.raises(openai.APIStatusError) as warming:
        client.completions.create(model="warming", prompt="Hi")
    assert warming.value.status_code == 503
    assert warming.value.response.json()["error"]["message"] == "model `warming` has no workers yet"


def test_completion_n2_tokens_out_of_order(
    client: openai.OpenAI,
    gateway: tuple[str, ZmqBackend],
    cluster: FakeCluster,
    tok: Tokenizer,
    outputs: list[list[int]],
) -> None:
    texts = [tok.decode(ids[:-1]) for ids in outputs]
    assert texts == TEXTS
    full = client.completions.create(model="tiny", prompt="Hi", n=2, max_tokens=16)
    assert [(c.index, c.text, c.finish_reason) for c in full.choices] == [
        (0, texts[0], "stop"), (1, texts[1], "stop"),
    ]  # fmt: skip
    assert full.usage is not None and full.usage.completion_tokens == sum(map(len, outputs))
    (g,) = cluster.generates
    assert g == m.Generate(
        request_id=full.id,
        model="tiny",
        prompt_token_ids=tok.encode("Hi"),
        sampling=m.SamplingParams(max_tokens=16),
        n=2,
        stream_address=gateway[1].stream_address,
        share=m.Share(tenant="default", tier=m.Tier.STANDARD, weight=1),  # an open API's
    )
    batch = client.completions.create(model="tiny", prompt=["Hi", "Yo"], n=2, max_tokens=16)
    assert [c.text for c in batch.choices] == [*texts, *texts]
    assert sorted(g.request_id for g in cluster.generates[1:]) == [f"{batch.id}-0",
                                                                 f"{batch.id}-1"]  # fmt: skip


def test_chat_stream_n2(client: openai.OpenAI, outputs: list[list[int]], tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, n=2, stream=True)  # type: ignore[arg-type]
    texts, reasons = ["", ""], [None, None]
    for part in stream:
        for c in part.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [tok.decode(ids[:-1]) for ids in outputs]
    assert reasons == ["stop", "stop"]


@pytest.mark.parametrize("status", [429, 503])
def test_admission_failure_is_the_http_status(
    status: int, url: str, client: openai.OpenAI, cluster: FakeCluster
) -> None:
    cluster.respond = lambda g: [
        ("coordinator", m.RequestError(request_id=g.request_id, status=status, message="no room"))
    ]
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt="Hi")
    code, kind = {429: ("rate_limit_exceeded", "rate_limit_error"),
                  503: ("service_unavailable", "server_error")}[status]  # fmt: skip
    assert refused.value.status_code == status
    error = {"message": "no room", "type": kind, "param": None, "code": code}
    assert refused.value.response.json() == {"error": error}
    assert refused.value.response.headers["retry-after"] == "1"
    # A stream's headers wait for its first token, so its refusal has the same status.
    body = {"model": "tiny", "prompt": "Hi", "stream": True}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert (response.status_code, response.json()) == (status, {"error": error})
    assert response.headers["retry-after"] == "1"


def test_stream_error_after_first_token_is_an_event(url: str, cluster: FakeCluster) -> None:
    token_read = threading.Event()  # the error comes once the client has the first token
    cluster.respond = lambda g: [
        ("coordinator", m.Accepted(g.request_id, 0)),
        ("prefill", chunk(g, 0, 0, [100])),
        ("wait", token_read),
        ("coordinator", died(g, 503)),
    ]
    body = {"model": "tiny", "prompt": "Hi", "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        events = [next(line for line in lines if line)]
        token_read.set()
        events += [line for line in lines if line]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["index"] == 0
    assert json.loads(events[-2].removeprefix("data: "))["error"]["message"] == (
        "decode worker d0 died"
    )
    assert events[-1] == "data: [DONE]"


def test_error_after_first_token(url: str, client: openai.OpenAI, cluster: FakeCluster) -> None:
    cluster.respond = lambda g: [
        ("prefill", chunk(g, 0, 0, [100])),
        ("coordinator", died(g, 500)),
    ]
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(model="tiny", prompt="Hi")
    assert failed.value.response.json()["error"]["message"] == "decode worker d0 died"


def test_silent_coordinator_fails_waiting_requests(
    cluster: FakeCluster, tiny_dir: Path, tmp_path: Path
) -> None:
    def falls_silent(g: m.Generate) -> list[tuple[str, Any]]:
        cluster.state = None  # no answer, and no ClusterState from now on
        return []

    cluster.respond = falls_silent
    cluster.state = state_for(tiny_dir, tmp_path)
    with zmq_gateway(cluster, state_timeout_s=SILENT_S) as (url, _):
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
        with pytest.raises(openai.APIStatusError) as failed:
            openai_client(url).completions.create(model="tiny", prompt="Hi")
    assert failed.value.status_code == 503
    wait_until(lambda: len(cluster.generates) == 1, what="the Generate at the cluster")
    rid = cluster.generates[0].request_id
    message = f"no answer from the coordinator for request {rid}"
    assert failed.value.response.json()["error"]["message"] == message


def test_request_timeout_aborts_on_the_cluster(
    cluster: FakeCluster, tiny_dir: Path, tmp_path: Path
) -> None:
    cluster.state = state_for(tiny_dir, tmp_path)
    cluster.respond = lambda g: [("prefill", chunk(g, 0, 0, [100]))]  # then nothing
    with zmq_gateway(cluster, config=GatewayConfig(request_timeout_s=0.5)) as (url, _):
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
        body = {"model": "tiny", "prompt": "Hi"}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        wait_until(lambda: len(cluster.aborts) == 1, what="the abort at the cluster")
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert cluster.aborts == [m.Abort(cluster.generates[0].request_id, "gateway")]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_sends_abort(
    stream: bool, url: str, client: openai.OpenAI, cluster: FakeCluster, outputs: list[list[int]]
) -> None:
    cluster.respond = lambda g: [("prefill", chunk(g, 0, 0, [100]))]  # then nothing
    body = {"model": "tiny", "prompt": "Hi", "stream": stream}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            next(response.iter_lines())  # the first token's event
    else:
        with abandoned_post(url, "/v1/completions", body):
            wait_until(lambda: len(cluster.generates) == 1, what="the Generate at the cluster")
    assert wait_for(lambda: len(cluster.aborts) == 1)
    assert cluster.aborts == [m.Abort(cluster.generates[0].request_id, "gateway")]
    cluster.respond = scripted(outputs)
    assert client.completions.create(model="tiny", prompt="Hi").choices[0].text == TEXTS[0]


def test_bad_messages_on_the_stream_are_dropped(
    url: str,
    gateway: tuple[str, ZmqBackend],
    client: openai.OpenAI,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pdserve.gateway.zmq_backend")
    bad = [
        [b"garbage"],
        [msgpack.packb({"type": "nope", "v": 1})],
        [*encode(m.Abort("x", "y")), b"extra frame"],
    ]
    expected = []
    for frames in bad:
        with pytest.raises(ProtocolError) as e:
            decode(frames)
        expected.append(f"dropped a bad message on the token stream: {e.value}")
    expected.append("dropped an unexpected Abort on the token stream")
    unknown = m.TokenChunk(request_id="no-such-request", choice=0, index=0, token_ids=[1],
                           logprobs=None, finished=True, finish_reason="stop",
                           num_prompt_tokens=1, num_cached_tokens=0)  # fmt: skip
    # (silent)
    # one socket, one receive loop: once the line for a last Abort is in, the unknown chunk
    # before it was handled, and had it said anything it would stand before that line
    last = m.Abort("after the unknown chunk", "y")
    expected.append("dropped an unexpected Abort on the token stream")
    ctx = zmq.Context()
    rogue = make_socket(ctx, zmq.PUSH, gateway[1].stream_address, bind=False)
    try:
        for frames in [*bad, encode(m.Abort("x", "y")), encode(m.TokenBatch(chunks=[unknown]))]:
            rogue.send_multipart(frames)
        rogue.send_multipart(encode(last))
        assert wait_for(lambda: len(caplog.records) >= len(expected))
    finally:
        ctx.destroy(linger=0)
    assert [r.getMessage() for r in caplog.records] == expected
    assert client.completions.create(model="tiny", prompt="Hi").choices[0].text == TEXTS[0]


def test_metrics_has_per_worker_gauges(url: str) -> None:
    families = parse_prometheus(httpx.get(f"{url}/metrics").text)
    prefill = (("role", "prefill"), ("worker", "p0"))
    decode_ = (("role", "decode"), ("worker", "d0"))
    expected = {
        "pdserve_kv_blocks_used": (3, 10),
        "pdserve_kv_blocks_total": (64, 128),
        "pdserve_requests_running": (1, 2),
        "pdserve_requests_waiting": (2, 0),
    }
    for name, (p, d) in expected.items():
        assert families[name] == ("gauge", {(name, prefill): p, (name, decode_): d})


def ending(choice: int, index: int, ids: list[int], finished: bool, reason: str) -> m.TokenChunk:
    """A chunk of request "r" (12 prompt tokens) with ``finished`` and ``reason`` as given."""
    return m.TokenChunk(
        request_id="r",
        choice=choice,
        index=index,
        token_ids=ids,
        logprobs=None,
        finished=finished,
        finish_reason=reason,
        num_prompt_tokens=12,
        num_cached_tokens=0,
    )


def test_a_finish_the_gateway_never_asked_for_fails_the_request() -> None:
    for reason in ("stop", "length"):
        check_finish(ending(0, 0, [7], True, reason))
    check_finish(ending(0, 0, [7], False, "abort"))  # not finished
    with pytest.raises(BackendError) as aborted:
        check_finish(ending(0, 0, [], True, "abort"))
    assert (aborted.value.status, aborted.value.message) == (
        503, "request r choice 0 was aborted by the cluster",
    )  # fmt: skip
    with pytest.raises(BackendError, match="request r choice 1 ended with 'eos'"):
        check_finish(ending(1, 3, [], True, "eos"))


def test_sampling_goes_on_the_wire_as_it_is() -> None:
    """No conversion is left to fail: a parameter the protocol has no field for cannot be made,
    and what is made travels whole (``Generate`` carries the gateway's own object)."""
    sampling = m.SamplingParams(max_tokens=5, seed=3)
    sent = m.Generate(request_id="r", model="tiny", prompt_token_ids=[1], sampling=sampling,
                      n=1, stream_address="ipc://gw")  # fmt: skip
    assert decode(encode(sent)).sampling == sampling
    with pytest.raises(TypeError, match="best_of"):
        m.SamplingParams(best_of=2)  # type: ignore[call-arg]


def test_submit_without_a_coordinator_is_503() -> None:
    async def run() -> BackendError:
        port_owner = http_socket("127.0.0.1", 0)  # bound, never listening: connections fail
        address = f"tcp://127.0.0.1:{port_owner.getsockname()[1]}"
        backend = ZmqBackend(address)
        await backend.start()
        try:
            with pytest.raises(BackendError) as refused:
                await backend.submit(generate("r", [1, 2], m.SamplingParams(max_tokens=2)))
            await backend.abort("r")  # idempotent, and harmless with no coordinator
            await backend.abort("r")
            return refused.value
        finally:
            await backend.close()
            port_owner.close()

    error = asyncio.run(run())
    assert error.status == 503
    assert error.message.startswith("the coordinator at tcp://127.0.0.1:")


def test_gateway_args(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COORDINATOR_ENV, "tcp://10.0.0.5:7000")
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    assert vars(parser.parse_args(["--port", "0"])) == {
        "host": "127.0.0.1", "port": 0, "coordinator": "tcp://10.0.0.5:7000",
        "stream_bind": "tcp://127.0.0.1:0", "log_level": "info", "max_migrations": 3,
        "request_timeout": 600.0,
        "max_pending_requests": 1024, "max_body_bytes": 8 * 1024 * 1024, "drain_timeout": 30.0,
        "api_key": [], "api_key_file": None, "stream_idle_timeout": 180.0,
        "stream_send_timeout": 30.0, "max_stream_backlog": 4096, "header_timeout": 10.0,
        "body_timeout": 30.0, "max_connections": 2048, "model_alias": [], "chat_template": None,
        "allowed_origins": [], "allowed_methods": ["*"], "allowed_headers": ["*"],
        "allow_credentials": False, "tool_call_parser": "auto", "enable_auto_tool_choice": False,
        "tenants": None, "rate_limit_store": "memory", "rate_limit_gateways": 1, "usage_db": None,
        "rate_limit_store_password_file": None, "otlp_endpoint": None,
    }  # fmt: skip
    monkeypatch.delenv(COORDINATOR_ENV)
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert parser.parse_args(["--coordinator", "ipc:///run/c.sock"]).coordinator == (
        "ipc:///run/c.sock"
    )


def test_gateway_modules_do_not_import_torch() -> None:
    code = (
        "import sys, pdserve.gateway.main, pdserve.gateway.zmq_backend;"
        " print('torch' in sys.modules)"
    )
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "False"


def test_stream_headers_go_out_once_accepted(url: str, cluster: FakeCluster) -> None:
    """Acceptance, not the first token, lets the 200 out: a long prefill queue is no wait for
    headers, while every choice must be accepted before it."""
    first_token = threading.Event()  # no token is sent before the test has the headers
    cluster.respond = lambda g: [
        ("coordinator", m.Accepted(g.request_id, 0)),
        ("coordinator", m.Accepted(g.request_id, 1)),
        ("wait", first_token),
        ("prefill", chunk(g, 0, 0, [100], finish_reason="length")),
        ("prefill", chunk(g, 1, 0, [101], finish_reason="length")),
    ]
    body = {"model": "tiny", "prompt": "Hi", "stream": True, "n": 2, "max_tokens": 1}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        first_token.set()
        text = response.read().decode()
    assert text.endswith("data: [DONE]\n\n") and text.count('"finish_reason":"length"') == 2


def test_refusal_of_a_later_choice_refuses_the_request(url: str, cluster: FakeCluster) -> None:
    cluster.respond = lambda g: [
        ("coordinator", m.Accepted(g.request_id, 0)),
        (
            "coordinator",
            m.RequestError(
                request_id=g.request_id, status=503, message="no room for choice 1", choice=1
            ),
        ),
    ]
    body = {"model": "tiny", "prompt": "Hi", "stream": True, "n": 2}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert wait_for(
        lambda: [a.request_id for a in cluster.aborts] == [cluster.generates[0].request_id]
    )
