"""The gateway over real HTTP: uvicorn on a loopback port, the official openai SDK as client,
and the fake backend (a test double for the ZMQ client) behind it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.app import create_app
from pdserve.protocol.control import WorkerLoad
from pdserve.protocol.messages import WorkerStatus
from pdserve.protocol.sampling import SamplingParams
from tests.gateway_util import (
    FakeBackend,
    Script,
    abandoned_post,
    parse_prometheus,
    running_server,
    served_model,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hello world! Héllo 今天 😀 done."
MESSAGES = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]
MODELS = [
    served_model("tiny-llama", max_model_len=2048, root="/models/llama"),
    served_model("tiny-qwen", max_model_len=128, root="/models/qwen"),
    served_model("no-tokenizer", max_model_len=64, root="/models/other"),
]


@pytest.fixture(scope="module")
def tokenizers(model_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {
        "tiny-llama": Tokenizer.from_dir(model_dirs["llama"]),
        "tiny-qwen": Tokenizer.from_dir(model_dirs["qwen2"]),
    }


@pytest.fixture(scope="module")
def server(tokenizers: dict[str, Tokenizer]) -> Iterator[tuple[str, FakeBackend]]:
    backend = FakeBackend(MODELS)
    with running_server(create_app(backend, tokenizers)) as url:
        yield url, backend


@pytest.fixture
def backend(server: tuple[str, FakeBackend]) -> FakeBackend:
    server[1].reset(Script([[1]]))
    server[1].healthy = True
    return server[1]


@pytest.fixture
def url(server: tuple[str, FakeBackend], backend: FakeBackend) -> str:
    return server[0]


@pytest.fixture
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


def script_for(tok: Tokenizer, *texts: str, **kw: Any) -> Script:
    """Each text as one choice's tokens, ending with the eos (finish "stop")."""
    eos = tok.eos_token_ids[0]
    return Script([[*tok.encode(t, add_special_tokens=False), eos] for t in texts], **kw)


def sse_events(response: httpx.Response) -> list[Any]:
    body = response.text
    assert body.endswith("\n\n")
    events = body[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen"])
def test_chat_streamed_equals_non_streamed(
    client: openai.OpenAI, backend: FakeBackend, tokenizers: dict[str, Tokenizer], model: str
) -> None:
    tok = tokenizers[model]
    backend.reset(script_for(tok, TEXT, cached_tokens=3))
    prompt = tok.encode_chat(MESSAGES)
    ids = tok.encode(TEXT, add_special_tokens=False)

    full = client.chat.completions.create(model=model, messages=MESSAGES)  # type: ignore[arg-type]
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert [
        (c.index, c.message.role, c.message.content, c.finish_reason) for c in full.choices
    ] == [(0, "assistant", TEXT, "stop")]
    assert full.usage is not None and full.usage.prompt_tokens_details is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        len(prompt),
        len(ids) + 1,
        len(prompt) + len(ids) + 1,
    )
    assert full.usage.prompt_tokens_details.cached_tokens == 3
    [request] = backend.submitted
    assert (request.request_id, request.model, request.prompt_token_ids, request.n) == (
        full.id,
        model,
        prompt,
        1,
    )
    max_len = next(m.max_model_len for m in MODELS if m.name == model)
    assert request.sampling == SamplingParams(max_tokens=max_len - len(prompt))

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == TEXT
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes == [None] * (len(chunks) - 2) + ["stop"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_completions_streamed_equals_non_streamed(
    client: openai.OpenAI, backend: FakeBackend, tokenizers: dict[str, Tokenizer]
) -> None:
    tok = tokenizers["tiny-llama"]
    backend.reset(script_for(tok, TEXT))
    ids = tok.encode(TEXT, add_special_tokens=False)
    full = client.completions.create(model="tiny-llama", prompt="Once upon", max_tokens=9)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert [(c.index, c.text, c.finish_reason) for c in full.choices] == [
        (0, tok.decode(ids[:9]), "length")
    ]
    prompt = tok.encode("Once upon")
    assert prompt[0] == tok.bos_token_id
    assert backend.submitted[0].prompt_token_ids == prompt
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(prompt), 9)

    stream = client.completions.create(
        model="tiny-llama", prompt="Once upon", max_tokens=9, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"

    backend.reset(script_for(tok, "abc"))
    by_ids = client.completions.create(model="tiny-llama", prompt=[5, 6, 7])
    assert backend.submitted[0].prompt_token_ids == [5, 6, 7]
    assert backend.submitted[0].sampling == SamplingParams(max_tokens=16)
    assert by_ids.choices[0].text == "abc"


def test_n2_out_of_order_choices(
    client: openai.OpenAI, backend: FakeBackend, tokenizers: dict[str, Tokenizer]
) -> None:
    tok = tokenizers["tiny-qwen"]
    texts = ["first choice 今天", "second 😀 one"]
    backend.reset(script_for(tok, *texts, prefill_last=True, decode_batch=2))
    full = client.chat.completions.create(model="tiny-qwen", messages=MESSAGES, n=2)  # type: ignore[arg-type]
    assert [(c.index, c.message.content, c.finish_reason) for c in full.choices] == [
        (0, texts[0], "stop"),
        (1, texts[1], "stop"),
    ]
    assert backend.submitted[0].n == 2
    lengths = [len(tok.encode(t, add_special_tokens=False)) + 1 for t in texts]
    assert full.usage is not None and full.usage.completion_tokens == sum(lengths)

    backend.reset(script_for(tok, *texts))  # token 0 of each choice first, then interleaved
    streamed = ["", ""]
    roles: list[int] = []
    for chunk in client.chat.completions.create(
        model="tiny-qwen",
        messages=MESSAGES,  # type: ignore[arg-type]
        n=2,
        stream=True,
    ):
        [choice] = chunk.choices
        streamed[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles.append(choice.index)
    assert streamed == texts and sorted(roles) == [0, 1]


def test_stop_strings_cut_the_text_and_abort(
    client: openai.OpenAI, backend: FakeBackend, tokenizers: dict[str, Tokenizer]
) -> None:
    tok = tokenizers["tiny-llama"]
    ids = tok.encode(TEXT, add_special_tokens=False)
    needed = next(k for k in range(len(ids) + 1) if "今天" in tok.decode(ids[:k]))
    backend.reset(script_for(tok, TEXT))
    full = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,  # type: ignore[arg-type]
        stop=["今天", "never"],
    )
    assert (full.choices[0].message.content, full.choices[0].finish_reason) == (
        "Hello world! Héllo ",
        "stop",
    )
    assert full.usage is not None and full.usage.completion_tokens == needed
    assert wait_for(lambda: backend.aborted == [full.id])

    backend.reset(script_for(tok, TEXT))
    chunks = list(
        client.completions.create(model="tiny-llama", prompt="x", stop="lo wor", stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == "Hel"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_for(lambda: backend.aborted == [chunks[0].id])


def test_include_usage_raw_sse(
    url: str, backend: FakeBackend, tokenizers: dict[str, Tokenizer]
) -> None:
    backend.reset(script_for(tokenizers["tiny-llama"], "ok"))
    body = {
        "model": "tiny-llama",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=20)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2
    assert all("usage" in e and e["usage"] is None for e in events[:-2])
    assert [e["choices"][0]["delta"] for e in events[:-2]] == [
        {"role": "assistant", "content": "ok"},
        {},
    ]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    for model in ("gpt-9", "no-tokenizer"):
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model=model, messages=MESSAGES)  # type: ignore[arg-type]
        assert info.value.code == "model_not_found"
        assert info.value.body == {
            "message": f"The model `{model}` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")


def test_a_served_model_whose_workers_are_away_is_503_not_404(
    client: openai.OpenAI, tokenizers: dict[str, Tokenizer], backend: FakeBackend
) -> None:
    """A restarted coordinator relearns its workers from their next Register: until then the
    model it served is unknown to it, which is a retryable 503 (a model never served: 404)."""
    backend.reset(script_for(tokenizers["tiny-qwen"], "ok"))
    client.chat.completions.create(model="tiny-qwen", messages=MESSAGES)  # served once
    models, tokenizer = backend.model_infos, tokenizers.pop("tiny-qwen")
    backend.model_infos = [info for info in models if info.name != "tiny-qwen"]
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="tiny-qwen", messages=MESSAGES)
        assert info.value.status_code == 503
        assert info.value.body["message"] == "model `tiny-qwen` has no workers yet"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-9", messages=MESSAGES)  # type: ignore[arg-type]
    finally:
        backend.model_infos, tokenizers["tiny-qwen"] = models, tokenizer


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 17}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"max_completion_tokens": 5000}, "messages"),
    ],
)
def test_bad_params_are_400(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    args = {"model": "tiny-llama", "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict)
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["param"] == param
    assert set(info.value.body) == {"message", "type", "param", "code"}


def test_malformed_bodies_are_400(url: str, tokenizers: dict[str, Tokenizer]) -> None:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    long_prompt = "word " * 200  # tiny-qwen serves 128 tokens
    response = httpx.post(
        f"{url}/v1/completions", json={"model": "tiny-qwen", "prompt": long_prompt}
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_backend_refusals(client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.reset(Script([[1]], reject_status=429))
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.body == {
        "message": "no capacity",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    backend.reset(Script([[1]], reject_status=503))
    with pytest.raises(openai.InternalServerError) as info2:
        client.completions.create(model="tiny-llama", prompt="x", stream=True)
    assert info2.value.status_code == 503


def test_unexpected_exception_is_an_openai_500(client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.reset(Script([[1]], crash_on_submit=True))
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.status_code == 500
    assert info.value.body == {
        "message": "internal error: RuntimeError: client bug",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def test_backend_error_mid_stream(
    client: openai.OpenAI, url: str, backend: FakeBackend, tokenizers: dict[str, Tokenizer]
) -> None:
    backend.reset(script_for(tokenizers["tiny-llama"], TEXT, fail_after=3))
    body = {"model": "tiny-llama", "prompt": "x", "stream": True}
    events = sse_events(httpx.post(f"{url}/v1/completions", json=body, timeout=20))
    assert [e["choices"][0]["text"] for e in events[:3]] == ["H", "el", "lo"]
    assert events[3:] == [
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
    with pytest.raises(openai.APIError, match="decode worker died"):
        list(client.completions.create(model="tiny-llama", prompt="x", stream=True))
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="tiny-llama", prompt="x")
    assert info.value.status_code == 500


def test_client_disconnect_aborts(
    url: str, backend: FakeBackend, tokenizers: dict[str, Tokenizer]
) -> None:
    backend.reset(script_for(tokenizers["tiny-llama"], TEXT, hang_after=2))
    body = {"model": "tiny-llama", "messages": MESSAGES, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=20) as response:
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line)[6:])
    assert wait_for(lambda: backend.aborted == [first["id"]])

    backend.reset(script_for(tokenizers["tiny-llama"], TEXT, hang_after=2))
    with abandoned_post(url, "/v1/completions", {"model": "tiny-llama", "prompt": "x"}):
        assert wait_for(lambda: len(backend.submitted) == 1)  # hung up once it is in
    assert wait_for(lambda: len(backend.aborted) == 1)
    assert backend.aborted == [backend.submitted[0].request_id]


def test_chat_logprobs(
    client: openai.OpenAI, backend: FakeBackend, tokenizers: dict[str, Tokenizer]
) -> None:
    tok = tokenizers["tiny-llama"]
    backend.reset(Script([tok.encode("Hi", add_special_tokens=False)], finish="length"))
    full = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        max_tokens=2,
    )
    assert backend.submitted[0].sampling == SamplingParams(max_tokens=2, logprobs=2)
    logprobs = full.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    got = [(t.token, t.logprob, t.bytes, [(a.token, a.logprob) for a in t.top_logprobs])
           for t in logprobs.content]  # fmt: skip
    next_of = {"H": tok.decode([tok.encode("H", add_special_tokens=False)[0] + 1]),
               "i": tok.decode([tok.encode("i", add_special_tokens=False)[0] + 1])}  # fmt: skip
    assert got == [
        ("H", -0.1, [72], [("H", -0.1), (next_of["H"], -1.1)]),
        ("i", -0.2, [105], [("i", -0.2), (next_of["i"], -1.2)]),
    ]


def test_models_and_health(url: str, backend: FakeBackend) -> None:
    assert httpx.get(f"{url}/v1/models").json() == {
        "object": "list",
        "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "pdserve",
             "root": m.root, "parent": None, "max_model_len": m.max_model_len}
            for m in MODELS[:2]
        ],
    }  # fmt: skip
    assert httpx.get(f"{url}/health").status_code == 200
    backend.healthy = False
    response = httpx.get(f"{url}/health")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "service_unavailable"


def test_metrics_endpoint(tokenizers: dict[str, Tokenizer]) -> None:
    tok = tokenizers["tiny-llama"]
    backend = FakeBackend(MODELS, script_for(tok, "ok"))
    backend.stats = [
        WorkerStatus(role="decode", worker_id="d0", model="tiny-llama",
                     load=WorkerLoad(free_blocks=59, used_blocks=5, total_blocks=64, running=1,
                                     waiting=0, queued_prompt_tokens=0))
    ]  # fmt: skip
    with running_server(create_app(backend, tokenizers)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES)  # type: ignore[arg-type]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-9", prompt="x")
        backend.script = Script([[1]], reject_status=429)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny-llama", prompt="x")
        response = httpx.get(f"{url}/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = parse_prometheus(response.text)
    requests = families["pdserve_requests_total"][1]
    assert requests == {  # a request's model once it was found (a 404's never is)
        ("pdserve_requests_total", (("model", model), ("outcome", o))): 1.0
        for model, o in (("", "invalid"), ("tiny-llama", "rejected"), ("tiny-llama", "success"))
    }
    prompt = len(tok.encode_chat(MESSAGES))
    assert families["pdserve_prompt_tokens_total"][1] == {
        ("pdserve_prompt_tokens_total", ()): prompt
    }
    generated = families["pdserve_generation_tokens_total"][1]
    assert generated == {("pdserve_generation_tokens_total", ()): 2.0}
    running = families["pdserve_requests_running"][1]
    assert running == {("pdserve_requests_running", (("role", "decode"), ("worker", "d0"))): 1.0}


def test_gateway_does_not_import_torch() -> None:
    modules = ["app", "backend", "choices", "errors", "run", "token_streams", "structured"]
    modules += ["jobs", "logprobs", "metrics", "observe.prometheus", "openai_models", "responses"]
    modules += ["embeddings", "prompt_scores", "responses_api.serve"]
    modules += ["admission", "config", "drain"]
    imports = "; ".join(f"import pdserve.gateway.{m}" for m in modules)
    code = f"import sys; {imports}; print('torch' in sys.modules)"
    env = dict(os.environ)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "False"


def test_before_any_worker_registers_every_model_is_503_not_404(
    client: openai.OpenAI, backend: FakeBackend
) -> None:
    """A gateway that knows no worker (starting, or its coordinator relearning them all) cannot
    tell a model that never was from one whose workers are away: a retryable 503 (as /health
    is), and 404 again once models are known."""
    models, backend.model_infos = backend.model_infos, []
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="gpt-9", messages=MESSAGES)  # type: ignore[arg-type]
        assert info.value.status_code == 503
        assert info.value.body["message"] == "no model has workers yet: the cluster is starting"
    finally:
        backend.model_infos = models
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)  # type: ignore[arg-type]
