"""Gateway bounds, in-process: a stream that hears nothing ends (error event, [DONE], abort), a
reader that stays behind is cut off and its request aborted at once, and an oversized prompt
is refused after tokenizing a bounded part of it."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.admission import Admission
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import OpenAIError
from pdserve.gateway.jobs import CHUNK_CHARS, check_prompt_size, prepare_completion
from pdserve.gateway.openai_models import CompletionRequest
from pdserve.gateway.run import JobRun
from tests.gateway_util import COMPLETION, MODELS, FakeBackend, Script, Serve, error


def sse_events(response: httpx.Response) -> list:
    lines = [x[6:] for x in response.text.split("\n\n") if x.startswith("data: ")]
    return [x if x == "[DONE]" else json.loads(x) for x in lines]


def test_a_stream_that_hears_nothing_ends_with_an_error(serve: Serve) -> None:
    config = GatewayConfig(stream_idle_timeout_s=0.3)
    served = serve(config, Script([[5, 6, 7]], hang_after=1))
    body = {**COMPLETION, "stream": True}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=10)
    events = sse_events(response)
    idle = error(
        "No progress from the cluster for 0.3 s: the request was ended.", "timeout", "server_error"
    )
    assert events[1:] == [idle, "[DONE]"]
    assert served.backend.aborted == [events[0]["id"]]
    assert served.metrics.requests.total(outcome="timeout") == 1


def test_a_reader_that_stays_behind_is_cut_off(tok: Tokenizer) -> None:
    ids = list(range(100, 300))
    backend = FakeBackend(MODELS, Script([ids]))
    request = CompletionRequest.model_validate({**COMPLETION, "max_tokens": 200, "stream": True})

    async def main() -> tuple[int, OpenAIError]:
        job = prepare_completion(request, tok, MODELS[0])
        job_run = JobRun(backend, tok, job, max_backlog=16)
        await job_run.start()
        updates = job_run.updates()
        await anext(updates)
        # the reader stalls; the cluster goes on, and the request is aborted at once
        for _ in range(50):
            await asyncio.sleep(0)
        assert backend.aborted == [job.requests[0].request_id]
        read = 1
        with pytest.raises(OpenAIError) as caught:
            async for _ in updates:
                read += 1
        return read, caught.value

    read, cut = asyncio.run(main())
    assert read <= 18  # what was queued before the cut, not the whole stream
    assert (cut.status, cut.code) == (408, "slow_reader")


class CountingTokenizer:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.chars = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return self.tok.encode(text, add_special_tokens)


def test_an_oversized_prompt_is_refused_after_a_bounded_part(tok: Tokenizer) -> None:
    counting = CountingTokenizer(tok)
    huge = "lorem ipsum dolor sit amet " * 300_000  # 8 MB
    with pytest.raises(OpenAIError) as refused:
        check_prompt_size(huge, counting, 2048, "prompt")  # type: ignore[arg-type]
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    assert counting.chars <= CHUNK_CHARS
    # a long prompt within the context passes and is then tokenized whole as before
    fits = "hello " * 20_000
    check_prompt_size(fits, counting, len(tok.encode(fits)) + 1, "prompt")  # type: ignore[arg-type]


def test_an_oversized_prompt_is_a_400_over_http(serve: Serve) -> None:
    served = serve(GatewayConfig())
    body = {**COMPLETION, "prompt": "word " * 1_000_000}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert served.backend.submitted == []


def test_a_slow_body_holds_no_slot(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    served = serve(GatewayConfig(max_pending_requests=1, body_timeout_s=0.5))
    reading = threading.Event()  # the gateway has the slow request and waits for its body
    read_body = Admission._read_body

    async def noted(self: Admission, scope: Any, receive: Any) -> Any:
        reading.set()
        return await read_body(self, scope, receive)

    monkeypatch.setattr(Admission, "_read_body", noted)

    async def main() -> tuple[int, int]:
        async def trickle():
            yield b'{"model": '
            await asyncio.sleep(1.5)
            yield b'"tiny"}'

        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(base_url=served.url, timeout=10) as client:
            slow = asyncio.create_task(
                client.post("/v1/completions", content=trickle(), headers=headers)
            )
            assert await asyncio.to_thread(reading.wait, 60)
            ok = await client.post("/v1/completions", json=COMPLETION)  # the slot is free
            return ok.status_code, (await slow).status_code

    ok, slow = asyncio.run(main())
    assert (ok, slow) == (200, 408)
