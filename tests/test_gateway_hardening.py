"""Gateway protections over real HTTP (uvicorn on loopback, the fake backend, a test double for
the ZMQ client, behind it): request timeout, in-flight limit, Retry-After, the drain flag."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.admission import AdmissionState
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.drain import shutdown_error
from pdserve.gateway.jobs import prepare_completion
from pdserve.gateway.openai_models import CompletionRequest
from pdserve.gateway.responses import stream_events
from pdserve.gateway.run import JobRun
from tests.gateway_util import (
    COMPLETION,
    MODELS,
    FakeBackend,
    Script,
    Serve,
    abandoned_post,
    error,
    parse_prometheus,
    wait_for,
    wait_until,
)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}


def sse(response: httpx.Response) -> list[Any]:
    events = response.text.removesuffix("\n\n").split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def in_flight(url: str) -> float:
    families = parse_prometheus(httpx.get(f"{url}/metrics").text)
    name = "pdserve_gateway_requests_in_flight"
    return families[name][1][(name, ())]


# ---- request timeout ---------------------------------------------------------------------------

TIMEOUT = error(
    "The request did not finish within the server's request timeout (0.3 s).",
    "timeout",
    "server_error",
)


def test_timeout_non_streaming_is_504_and_aborts(serve: Serve) -> None:
    served = serve(GatewayConfig(request_timeout_s=0.3), Script([[5, 6, 7]], hang_after=1))
    response = httpx.post(f"{served.url}/v1/completions", json=COMPLETION, timeout=60)
    # what ended the hung request: the gateway's timeout, as it says (the 504 names it, and it
    # counts the outcome), never the client's
    assert (response.status_code, response.json()) == (504, TIMEOUT)
    assert served.backend.aborted == [served.backend.submitted[0].request_id]
    assert served.metrics.requests.total(outcome="timeout") == 1
    assert served.metrics.requests.total(outcome="error") == 0


def test_timeout_streaming_ends_with_an_error_event(serve: Serve, tok: Tokenizer) -> None:
    served = serve(GatewayConfig(request_timeout_s=0.3), Script([[5, 6, 7]], hang_after=1))
    body = {**CHAT, "stream": True}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    events = sse(response)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": tok.decode([5])}
    assert events[1:] == [TIMEOUT, "[DONE]"]
    assert served.backend.aborted == [events[0]["id"]]
    assert served.metrics.requests.total(outcome="timeout") == 1


def test_timeout_while_submitting(serve: Serve) -> None:
    served = serve(GatewayConfig(request_timeout_s=0.3), Script([[1]], hang_on_submit=True))
    for stream in (False, True):
        body = {**COMPLETION, "stream": stream}
        response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        assert (response.status_code, response.json()) == (504, TIMEOUT)
    assert len(served.backend.submitted) == 2
    assert served.backend.aborted == [r.request_id for r in served.backend.submitted]
    assert served.metrics.requests.total(outcome="timeout") == 2


def test_no_timeout_when_off(serve: Serve) -> None:
    served = serve(GatewayConfig(request_timeout_s=0), Script([[5, 6, 7]], hang_after=1))
    with abandoned_post(served.url, "/v1/completions", COMPLETION) as client:
        wait_until(lambda: len(served.backend.submitted) == 1, what="the request submitted")
        client.settimeout(1.0)
        with pytest.raises(TimeoutError):
            client.recv(1)  # a second without an answer: no timeout ended it
    wait_until(lambda: len(served.backend.aborted) == 1, what="the abort on the disconnect")
    assert served.metrics.requests.total(outcome="timeout") == 0


# ---- overload and Retry-After ------------------------------------------------------------------


def test_in_flight_limit_is_429_with_retry_after(serve: Serve) -> None:
    served = serve(GatewayConfig(max_pending_requests=2), Script([[5, 6]], hang_after=0))
    url = served.url
    body = {**COMPLETION, "stream": True}
    with (
        httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as first,
        httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as second,
    ):
        assert (first.status_code, second.status_code) == (200, 200)
        assert wait_for(lambda: in_flight(url) == 2)
        refused = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json() == error(
            "The server is overloaded (2 requests in flight); retry later.",
            "rate_limit_exceeded",
            "rate_limit_error",
        )
        assert httpx.get(f"{url}/v1/models").status_code == 200  # only generations count
        assert httpx.get(f"{url}/health").status_code == 200
    assert wait_for(lambda: in_flight(url) == 0)
    assert wait_for(lambda: len(served.backend.aborted) == 2)
    served.backend.script.hang_after = None
    assert httpx.post(f"{url}/v1/completions", json=COMPLETION).status_code == 200
    assert served.metrics.requests.total(outcome="rejected") == 1


@pytest.mark.parametrize("status", [429, 503])
def test_backend_refusals_carry_retry_after(serve: Serve, status: int) -> None:
    url = serve(GatewayConfig(), Script([[1]], reject_status=status)).url
    response = httpx.post(f"{url}/v1/completions", json=COMPLETION)
    assert response.status_code == status
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["message"] == "no capacity"
    response = httpx.post(f"{url}/v1/completions", json={**COMPLETION, "model": "gpt-9"})
    assert response.status_code == 404 and "retry-after" not in response.headers


# ---- draining (the signal handling is tested with a real process) ------------------------------


def test_draining_refuses_new_requests(serve: Serve, tok: Tokenizer) -> None:
    ids = tok.encode("one two three", add_special_tokens=False)
    served = serve(GatewayConfig(), Script([ids], hang_after=2))
    url = served.url
    body = {**COMPLETION, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as running:
        lines = running.iter_lines()  # held: a dropped iterator closes the response
        first = json.loads(next(line for line in lines if line)[6:])
        served.admission.draining = True
        response = httpx.post(f"{url}/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json() == error(
            "The server is draining: it takes no new requests.",
            "service_unavailable",
            "server_error",
        )
        assert httpx.get(f"{url}/v1/models").status_code == 503
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.json() == error("draining", "draining", "server_error")
        assert in_flight(url) == 1  # /metrics stays open
    assert wait_for(lambda: served.backend.aborted == [first["id"]])
    assert wait_for(lambda: in_flight(url) == 0)
    assert served.metrics.requests.total(outcome="rejected") == 1


def test_expire_all_ends_running_streams(tok: Tokenizer) -> None:
    ids = tok.encode("one two three", add_special_tokens=False)
    backend = FakeBackend(MODELS, Script([ids], hang_after=2))
    request = CompletionRequest.model_validate({**COMPLETION, "stream": True})

    async def main() -> tuple[list[str], int, int]:
        state = AdmissionState()
        job_run = JobRun(backend, tok, prepare_completion(request, tok, MODELS[0]))
        state.runs.add(job_run)
        await job_run.start()
        stream = stream_events(job_run)
        events = [await anext(stream), await anext(stream)]
        ended = state.expire_all(shutdown_error())
        events += [e async for e in stream]
        return events, ended, state.expire_all(shutdown_error())

    events, ended, again = asyncio.run(main())
    assert (ended, again) == (1, 0)
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]]
    assert "".join(texts) == tok.decode(ids[:2])
    shutdown = error(
        "The server shut down before the request finished.", "service_unavailable", "server_error"
    )
    assert events[2:] == [
        f"data: {json.dumps(shutdown, separators=(',', ':'))}\n\n",
        "data: [DONE]\n\n",
    ]
    assert backend.aborted == [backend.submitted[0].request_id]
