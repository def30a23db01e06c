"""Response and chunk builders, and a JobRun driven by the fake backend without HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.choices import ChoiceUpdate
from pdserve.gateway.jobs import Job
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.responses import (
    ChoiceResult,
    ChunkEvents,
    chunk_body,
    chunk_choice,
    collect,
    response_body,
    sse,
    stream_events,
    usage_body,
)
from pdserve.gateway.run import JobRun, Usage
from pdserve.protocol.sampling import SamplingParams
from tests.gateway_util import FakeBackend, Script, generate

HI = [39, 72, 259, 263]  # H|i| the|re
EOS = 2046


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]) -> Tokenizer:
    tok = Tokenizer.from_dir(model_dirs["llama"])
    assert tok.decode(HI) == "Hi there"
    return tok


def job(kind: str = "chat", n: int = 1, prompts: int = 1, **kw: Any) -> Job:
    rid = "chatcmpl-1" if kind == "chat" else "cmpl-1"
    sampling = SamplingParams(max_tokens=16, logprobs=kw.pop("k", None))
    requests = [
        generate(rid if prompts == 1 else f"{rid}-{i}", [1, 2, 3], sampling, n)
        for i in range(prompts)
    ]
    return Job(kind=kind, response_id=rid, model="tiny", requests=requests, n=n, created=123, **kw)  # type: ignore[arg-type]


def run_stream(backend: FakeBackend, tok: Tokenizer, j: Job, **kw: Any) -> list[Any]:
    async def main() -> list[str]:
        job_run = JobRun(backend, tok, j, **kw)
        await job_run.start()
        return [e async for e in stream_events(job_run)]

    events = asyncio.run(main())
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    return [e[6:-2] if e == "data: [DONE]\n\n" else json.loads(e[6:-2]) for e in events]


def run_collect(backend: FakeBackend, tok: Tokenizer, j: Job) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        job_run = JobRun(backend, tok, j)
        await job_run.start()
        return await collect(job_run)

    return asyncio.run(main())


def fake(script: Script) -> FakeBackend:
    return FakeBackend([], script)


def chat_chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 123, "model": "tiny"}
    return {**head, "choices": choices, **extra}


def delta(
    content: str | None, index: int = 0, finish: str | None = None, role: bool = False
) -> dict:
    d: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        d["content"] = content
    return {"index": index, "delta": d, "logprobs": None, "finish_reason": finish}


def test_usage_body() -> None:
    assert usage_body(Usage(7, 3, 4)) == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_response_bodies() -> None:
    results = [ChoiceResult("a", "stop"), ChoiceResult("b", "length")]
    usage = usage_body(Usage(3, 2, 0))
    assert response_body(job("chat", n=2), results, Usage(3, 2, 0)) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 123,
        "model": "tiny",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "a"}, "logprobs": None,
             "finish_reason": "stop"},
            {"index": 1, "message": {"role": "assistant", "content": "b"}, "logprobs": None,
             "finish_reason": "length"},
        ],
        "usage": usage,
    }  # fmt: skip
    assert response_body(job("completion", n=2), results, Usage(3, 2, 0)) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 123,
        "model": "tiny",
        "choices": [
            {"index": 0, "text": "a", "logprobs": None, "finish_reason": "stop"},
            {"index": 1, "text": "b", "logprobs": None, "finish_reason": "length"},
        ],
        "usage": usage,
    }


def test_chat_stream_exact(tokenizer: Tokenizer) -> None:
    backend = fake(Script([[*HI, EOS]], cached_tokens=2))
    events = run_stream(backend, tokenizer, job(include_usage=True, stream=True))
    assert events == [
        chat_chunk([delta("H", role=True)], usage=None),
        chat_chunk([delta("i")], usage=None),
        chat_chunk([delta(" the")], usage=None),
        chat_chunk([delta("re")], usage=None),
        chat_chunk([delta(None, finish="stop")], usage=None),
        chat_chunk([], usage=usage_body(Usage(3, 5, 2))),
        "[DONE]",
    ]
    assert backend.aborted == []  # finished by the backend: nothing to abort


def test_chat_stream_without_usage_has_no_usage_key(tokenizer: Tokenizer) -> None:
    events = run_stream(fake(Script([[39, EOS]])), tokenizer, job())
    assert events == [
        chat_chunk([delta("H", role=True)]),
        chat_chunk([delta(None, finish="stop")]),
        "[DONE]",
    ]


def test_two_choices_out_of_order_and_stop_string(tokenizer: Tokenizer) -> None:
    script = Script([[*HI, EOS], [39, 72, EOS]], prefill_last=True)
    j = job("chat", n=2, stops=["the"])
    events = run_stream(backend := fake(script), tokenizer, j)
    # Decode tokens (1..) arrive first and wait for token 0, then go out one event each (the
    # reader keeps up); " the" completes the stop string "the", so choice 0 ends at token 2.
    assert events == [
        chat_chunk([delta("H", role=True, index=0)]),
        chat_chunk([delta("i", index=0)]),
        chat_chunk([delta(" ", index=0, finish="stop")]),
        chat_chunk([delta("H", role=True, index=1)]),
        chat_chunk([delta("i", index=1)]),
        chat_chunk([delta(None, index=1, finish="stop")]),
        "[DONE]",
    ]
    assert backend.aborted == []  # every event came before token 0: nothing left to abort
    body = run_collect(backend := fake(Script([[*HI, EOS]])), tokenizer, job("chat", stops=["the"]))
    assert body["choices"][0]["message"]["content"] == "Hi "
    assert body["usage"]["completion_tokens"] == 3
    assert backend.aborted == ["chatcmpl-1"]


def test_error_mid_stream_ends_with_error_event(tokenizer: Tokenizer) -> None:
    backend = fake(Script([[*HI, EOS]], fail_after=2))
    events = run_stream(backend, tokenizer, job(include_usage=True))
    assert events == [
        chat_chunk([delta("H", role=True)], usage=None),
        chat_chunk([delta("i")], usage=None),
        {
            "error": {
                "message": "decode worker died",
                "type": "server_error",
                "param": None,
                "code": "internal_error",
            }
        },
        "[DONE]",
    ]
    assert backend.aborted == ["chatcmpl-1"]


def test_completion_stream_with_logprobs_and_two_prompts(tokenizer: Tokenizer) -> None:
    backend = fake(Script([[39, 72]], finish="length", decode_batch=2))
    j = job("completion", n=1, prompts=2, logprobs=True, k=1)
    events = run_stream(backend, tokenizer, j)
    head = {"id": "cmpl-1", "object": "text_completion", "created": 123, "model": "tiny"}

    def lp(token: str, value: float, offset: int) -> dict[str, Any]:
        return {
            "tokens": [token],
            "token_logprobs": [value],
            "top_logprobs": [{token: value}],
            "text_offset": [offset],
        }

    def choice(i: int, text: str, logprobs: dict, finish: str | None) -> dict[str, Any]:
        return {**head, "choices": [
            {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        ]}  # fmt: skip

    assert events == [
        choice(0, "H", lp("H", -0.1, 0), None),
        choice(1, "H", lp("H", -0.1, 0), None),
        choice(0, "i", lp("i", -0.2, 1), "length"),
        choice(1, "i", lp("i", -0.2, 1), "length"),
        "[DONE]",
    ]


def test_collect_equals_stream_and_counts_metrics(tokenizer: Tokenizer) -> None:
    ticks = iter(range(100))
    metrics = GatewayMetrics()
    # Choice 1 ends in "stop" too, so its last token (72, "i") is taken for the eos.
    script = Script([[*HI, EOS], [263, 39, 72]], prefill_last=True, decode_batch=2)
    events = run_stream(
        fake(script), tokenizer, job(n=2), metrics=metrics, clock=lambda: float(next(ticks))
    )
    streamed = ["", ""]
    for e in events[:-1]:
        for c in e["choices"]:
            streamed[c["index"]] += c["delta"].get("content", "")
    body = run_collect(fake(script), tokenizer, job(n=2))
    assert [c["message"]["content"] for c in body["choices"]] == streamed == ["Hi there", "reH"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
    assert body["usage"] == usage_body(Usage(3, 8, 0))
    assert metrics.requests.total(outcome="success") == 1
    assert metrics.prompt_tokens.value() == 3
    assert metrics.generation_tokens.value() == 8
    assert metrics.ttft.count(model="tiny") == 1 and metrics.e2e.count(model="tiny") == 1
    assert metrics.itl.count(model="tiny") == 8 - 2  # every token but each choice's first


def test_rejected_submit_raises_before_any_output(tokenizer: Tokenizer) -> None:
    from pdserve.gateway.backend import BackendError

    backend = fake(Script([[39]], reject_status=429))
    with pytest.raises(BackendError) as info:
        run_stream(backend, tokenizer, job())
    assert info.value.status == 429


def test_sse_escapes_what_line_splitters_break_on() -> None:
    """json.dumps leaves U+2028, U+2029 and U+0085 raw; many SSE clients split lines there."""
    body = {"text": "a\u2028b\u2029c\x85d é 中"}
    event = sse(body)
    assert event == 'data: {"text":"a\\u2028b\\u2029c\\u0085d é 中"}\n\n'
    assert event[:-2].splitlines() == [event[:-2]]
    assert json.loads(event[len("data: ") :]) == body


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "options",
    [{}, {"include_usage": True}, {"include_usage": True, "continuous_usage": True},
     {"system_fingerprint": "fp\u2028x"}],
)  # fmt: skip
def test_chunk_events_are_the_chunk_bodies_to_the_byte(kind: str, options: dict) -> None:
    j = job(kind, **options)
    j = Job(**{**j.__dict__, "model": 'ti"ny\u2029 "choices":[é'})  # what the envelope escapes
    events = ChunkEvents(j)
    for update in [ChoiceUpdate(0, 'a\u2028"b', 1, True), ChoiceUpdate(0, "", 1, False, "stop")]:
        choice = chunk_choice(j, update, update.first, [])
        usage = Usage(3, 1, 0) if j.continuous_usage else None
        assert events.event(choice, usage) == sse(chunk_body(j, [choice], usage))
