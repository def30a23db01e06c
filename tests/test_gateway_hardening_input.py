"""Hostile and malformed requests: each kind answered with a 4xx OpenAI error body while the
server stays healthy, and request limits at their exact boundaries. The fake backend (a test
double for the ZMQ client) answers whatever gets through."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.app import create_app
from tests.gateway_util import FakeBackend, Script, running_server, served_model

MODEL = served_model("tiny", max_model_len=64)
USER = [{"role": "user", "content": "Hi"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tok: Tokenizer) -> Iterator[tuple[str, FakeBackend]]:
    backend = FakeBackend([MODEL], Script([[5, 6, tok.eos_token_ids[0]]]))
    with running_server(create_app(backend, {"tiny": tok})) as url:
        yield url, backend


@pytest.fixture
def url(server: tuple[str, FakeBackend]) -> str:
    server[1].submitted.clear()
    return server[0]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def chat(**fields: Any) -> bytes:
    return body(model="tiny", messages=USER, **fields)


def completion(**fields: Any) -> bytes:
    return body(model="tiny", prompt="Hi", **fields)


C, CH = "/v1/completions", "/v1/chat/completions"
LIMIT = "Input should be less than or equal to"
STOP_LIMIT = (
    "stop: must be a string or a list of at most 4 strings, each at most 256 characters long"
)
# (path, raw body, headers, status, param, code, message)
BAD = {
    "invalid JSON": (C, b'{"model": "tiny",', JSON, 400, None, None,
                     "request body is not valid JSON: JSON decode error"),
    "NaN literal": (C, b'{"model":"tiny","prompt":"Hi","temperature":NaN}', JSON, 400,
                    "temperature", None, "temperature: Input should be a finite number"),
    "1e400 is infinite": (C, b'{"model":"tiny","prompt":"Hi","top_p":1e400}', JSON, 400,
                          "top_p", None, "top_p: Input should be a finite number"),
    "text/plain": (C, completion(), {"content-type": "text/plain"}, 415, None,
                   "unsupported_media_type",
                   "Unsupported Media Type: only 'application/json' is allowed, got 'text/plain'."),
    "no content type": (C, completion(), {}, 415, None, "unsupported_media_type",
                        "Unsupported Media Type: only 'application/json' is allowed, got no "
                        "content type."),
    "non-UTF-8 bytes": (C, b'{"model":"tiny","prompt":"\xff\xfe"}', JSON, 400, None, None,
                        "request body is not valid UTF-8: 'utf-8' codec can't decode byte 0xff "
                        "in position 26: invalid start byte"),
    "lone surrogate prompt": (C, b'{"model":"tiny","prompt":"a\\ud800"}', JSON, 400, "prompt",
                              None, "prompt is not valid Unicode: it holds a lone surrogate "
                              "(\\ud800)"),
    "lone surrogate message": (CH, b'{"model":"tiny","messages":[{"role":"user","content":'
                               b'"\\udc80"}]}', JSON, 400, "messages", None,
                               "messages is not valid Unicode: it holds a lone surrogate "
                               "(\\udc80)"),
    "lone surrogate model": (C, b'{"model":"\\ud800","prompt":"Hi"}', JSON, 404, "model",
                             "model_not_found", "The model `\ud800` does not exist."),
    "array body": (C, b"[1, 2]", JSON, 400, None, None,
                   "Input should be a valid dictionary or object to extract fields from"),
    "empty body": (C, b"", JSON, 400, None, None, "Field required"),
    "missing model": (C, body(prompt="Hi"), JSON, 400, "model", None, "model: Field required"),
    "missing prompt": (C, body(model="tiny"), JSON, 400, "prompt", None,
                       "prompt: Field required"),
    "missing messages": (CH, body(model="tiny"), JSON, 400, "messages", None,
                         "messages: Field required"),
    "model not a string": (C, body(model=5, prompt="Hi"), JSON, 400, "model", None,
                           "model: Input should be a valid string"),
    "max_tokens a word": (C, completion(max_tokens="many"), JSON, 400, "max_tokens", None,
                          "max_tokens: Input should be a valid integer, unable to parse string "
                          "as an integer"),
    "messages a string": (CH, body(model="tiny", messages="Hi"), JSON, 400, "messages", None,
                          "messages: Input should be a valid list"),
    "n fractional": (C, completion(n=1.5), JSON, 400, "n", None,
                     "n: Input should be a valid integer, got a number with a fractional part"),
    "prompt an object": (C, body(model="tiny", prompt={"a": 1}), JSON, 400, "prompt", None,
                         "prompt: Input should be a valid string (3 more errors)"),
    "message without role": (CH, body(model="tiny", messages=[{"content": "x"}]), JSON, 400,
                             "messages[0].role", None, "messages[0].role: Field required"),
    "unknown model": (C, body(model="gpt-9", prompt="Hi"), JSON, 404, "model",
                      "model_not_found", "The model `gpt-9` does not exist."),
    "empty messages": (CH, body(model="tiny", messages=[]), JSON, 400, "messages", None,
                       "messages: List should have at least 1 item after validation, not 0"),
    "empty prompt list": (C, body(model="tiny", prompt=[]), JSON, 400, "prompt", None,
                          "prompt must not be empty"),
    "negative max_tokens": (C, completion(max_tokens=-1), JSON, 400, "max_tokens", None,
                            "max_tokens: Input should be greater than or equal to 0"),
    "zero n": (C, completion(n=0), JSON, 400, "n", None,
               "n: Input should be greater than or equal to 1"),
    "negative temperature": (CH, chat(temperature=-0.5), JSON, 400, "temperature", None,
                             "temperature: Input should be greater than or equal to 0"),
    "negative logprobs": (C, completion(logprobs=-1), JSON, 400, "logprobs", None,
                          "logprobs: Input should be greater than or equal to 0"),
    "negative top_k": (C, completion(top_k=-2), JSON, 400, "top_k", None,
                       "top_k: Input should be greater than or equal to -1"),
    "negative token id": (C, body(model="tiny", prompt=[-1]), JSON, 400, "prompt", None,
                          "token id -1 is outside the vocabulary (size 2048)"),
    "huge max_tokens": (C, completion(max_tokens=10**30), JSON, 400, "prompt",
                        "context_length_exceeded",
                        "This model's maximum context length is 64 tokens. However, you "
                        f"requested {10**30 + 3} tokens (3 in the prompt, {10**30} in the "
                        "completion). Please reduce the length of the prompt or completion."),
    "huge n": (C, completion(n=10**6), JSON, 400, "n", None, f"n: {LIMIT} 16"),
    "huge seed": (C, completion(seed=2**64), JSON, 400, "seed", None,
                  f"seed: {LIMIT} 9223372036854775807"),
    "huge top_k": (C, completion(top_k=2**63), JSON, 400, "top_k", None,
                   f"top_k: {LIMIT} 9223372036854775807"),
    "huge token id": (C, body(model="tiny", prompt=[2**70]), JSON, 400, "prompt", None,
                      f"token id {2**70} is outside the vocabulary (size 2048)"),
    "huge penalty": (C, completion(frequency_penalty=1e300), JSON, 400, "frequency_penalty",
                     None, f"frequency_penalty: {LIMIT} 2"),
    "min_tokens beyond max_tokens": (C, completion(min_tokens=9, max_tokens=3), JSON, 400,
                                     "min_tokens", None,
                                     "min_tokens (9) must not exceed max_tokens (3)"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_4xx_openai_error(
    url: str, server: tuple[str, FakeBackend], case: str
) -> None:
    path, content, headers, status, param, code, message = BAD[case]
    response = httpx.post(f"{url}{path}", content=content, headers=headers)
    assert response.status_code == status
    assert response.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }
    assert server[1].submitted == []
    assert httpx.get(f"{url}/health").status_code == 200


LIMITS = {
    "n": (completion(n=17), "n", f"n: {LIMIT} 16"),
    "5 stop strings": (completion(stop=list("abcde")), "stop", STOP_LIMIT),
    "a stop string too long": (completion(stop="x" * 257), "stop", STOP_LIMIT),
    "a listed stop string too long": (chat(stop=["ok", "x" * 257]), "stop", STOP_LIMIT),
    "top_logprobs": (chat(logprobs=True, top_logprobs=21), "top_logprobs",
                     f"top_logprobs: {LIMIT} 20"),
    "completion logprobs": (completion(logprobs=21), "logprobs", f"logprobs: {LIMIT} 20"),
    "prompts": (body(model="tiny", prompt=["Hi"] * 257), "prompt",
                "at most 256 prompts in one request, got 257"),
    "token-id prompts": (body(model="tiny", prompt=[[5]] * 257), "prompt",
                         "at most 256 prompts in one request, got 257"),
}  # fmt: skip


@pytest.mark.parametrize("case", LIMITS)
def test_limits_beyond(url: str, case: str) -> None:
    content, param, message = LIMITS[case]
    path = CH if b'"messages"' in content else C
    response = httpx.post(f"{url}{path}", content=content, headers=JSON)
    assert (response.status_code, response.json()["error"]) == (400, {
        "message": message, "type": "invalid_request_error", "param": param, "code": None,
    })  # fmt: skip


def test_limits_at_the_boundary(url: str, server: tuple[str, FakeBackend]) -> None:
    at_limit = [
        (C, completion(n=16)),
        (C, completion(stop=["a", "b", "c", "x" * 256])),
        (CH, chat(stop="x" * 256, logprobs=True, top_logprobs=20)),
        (C, completion(logprobs=20)),
        (C, completion(seed=2**63 - 1, top_k=2**63 - 1)),
        (C, completion(seed=-(2**63))),
        (C, body(model="tiny", prompt=[[5]] * 256)),
    ]
    for path, content in at_limit:
        response = httpx.post(f"{url}{path}", content=content, headers=JSON)
        assert response.status_code == 200, response.text
    assert [r.n for r in server[1].submitted] == [16, 1, 1, 1, 1, 1] + [1] * 256
    assert server[1].submitted[4].sampling.seed == 2**63 - 1


def context_error(prompt: int, completion: int | None, param: str) -> dict[str, Any]:
    asked = f"{prompt} in the {param}" + (f", {completion} in the completion" if completion else "")
    tail = " or completion." if completion else "."
    message = (
        f"This model's maximum context length is 64 tokens. However, you requested "
        f"{prompt + (completion or 0)} tokens ({asked}). Please reduce the length of the "
        f"{param}{tail}"
    )
    return {"message": message, "type": "invalid_request_error", "param": param,
            "code": "context_length_exceeded"}  # fmt: skip


def test_context_length_boundaries(
    url: str, server: tuple[str, FakeBackend], tok: Tokenizer
) -> None:
    backend = server[1]

    def post(path: str, **fields: Any) -> httpx.Response:
        return httpx.post(f"{url}{path}", json={"model": "tiny", **fields})

    assert post(C, prompt=[5] * 60, max_tokens=4).status_code == 200
    assert post(C, prompt=[5] * 63).status_code == 200  # room for one token
    assert [r.sampling.max_tokens for r in backend.submitted] == [4, 1]
    refused = post(C, prompt=[5] * 60, max_tokens=5)
    assert (refused.status_code, refused.json()["error"]) == (400, context_error(60, 5, "prompt"))
    refused = post(C, prompt=[5] * 64)
    assert (refused.status_code, refused.json()["error"]) == (
        400,
        context_error(64, None, "prompt"),
    )
    room = 64 - len(tok.encode_chat(USER))
    assert post(CH, messages=USER, max_completion_tokens=room).status_code == 200
    assert backend.submitted[-1].sampling.max_tokens == room
    refused = post(CH, messages=USER, max_tokens=room + 1)
    expected = context_error(64 - room, room + 1, "messages")
    assert (refused.status_code, refused.json()["error"]) == (400, expected)
    long_chat = [{"role": "user", "content": "word " * 100}]
    refused = post(CH, messages=long_chat)
    prompt = len(tok.encode_chat(long_chat))
    assert (refused.status_code, refused.json()["error"]) == (
        400, context_error(prompt, None, "messages"),
    )  # fmt: skip
    assert len(backend.submitted) == 3


def test_wrong_method_or_path_is_an_openai_error(url: str) -> None:
    for method, path, status, message in [
        ("GET", C, 405, "Method Not Allowed"),
        ("PUT", CH, 405, "Method Not Allowed"),
        ("POST", "/v1/nothing", 404, "Not Found"),
        ("GET", "/v1", 404, "Not Found"),
    ]:
        response = httpx.request(method, f"{url}{path}")
        assert (response.status_code, response.json()) == (status, {
            "error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": None},
        })  # fmt: skip
