"""The API surface vLLM users rely on, through the app over HTTP (uvicorn on loopback, the fake
backend, a test double for the ZMQ client, behind it): /tokenize, /detokenize, /v1/models/{id},
/version, the developer role, continuous usage, system_fingerprint, X-Request-Id, CORS, model
aliases, --chat-template, the stop limit's message and the refusal of fields not honoured."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.api_extras import system_fingerprint
from pdserve.gateway.config import GatewayConfig
from pdserve.protocol import messages as m
from tests.gateway_util import FakeBackend, Script, Served, served_model, serving_config

TINY = served_model("tiny", max_model_len=64)
ALIASES = (("tiny-alias", "tiny"), ("org/tiny", "tiny"))
KEY = {"Authorization": "Bearer sk-test"}
TEMPLATE = (
    "{% if tools %}{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
STOP_LIMIT = (
    "stop: must be a string or a list of at most 4 strings, each at most 256 characters long"
)


@contextlib.contextmanager
def serve_with(tok: Tokenizer, **config: Any) -> Iterator[Served]:
    """The app over a fake backend that answers "Hello world"; ``template``: --chat-template."""
    eos = tok.eos_token_ids[0]
    backend = FakeBackend([TINY], Script([[*tok.encode("Hello world", False), eos]]))
    template = config.pop("template", None)
    served = tok if template is None else tok.with_chat_template(template)
    with serving_config(backend, {"tiny": served}, GatewayConfig(**config)) as s:
        yield s


@pytest.fixture(scope="module")
def server(tok: Tokenizer) -> Iterator[Served]:
    with serve_with(tok, model_aliases=ALIASES) as s:
        yield s


@pytest.fixture
def url(server: Served) -> str:
    server.backend.submitted.clear()
    return server.url


def post(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    """ASCII JSON: a lone surrogate travels as its escape."""
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(f"{url}{path}", content=json.dumps(body), headers=headers, timeout=20)


def test_tokenize_prompt_and_messages(url: str, tok: Tokenizer, server: Served) -> None:
    r = post(url, "/tokenize", {"model": "tiny", "prompt": "Hello world"})
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id
    assert r.json() == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    r = post(url, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False,
                                "return_token_strs": True})  # fmt: skip
    assert r.json()["tokens"] == ids[1:]  # no model: the only one served
    assert r.json()["token_strs"] == tok.convert_ids_to_tokens(ids[1:])
    # messages: the very ids a chat request sends to the backend
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = post(url, "/tokenize", {"model": "tiny-alias", "messages": messages})
    chat = post(url, "/v1/chat/completions", {"model": "tiny", "messages": messages})
    assert chat.status_code == 200
    assert r.json()["tokens"] == server.backend.submitted[-1].prompt_token_ids
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]


def test_detokenize(url: str, tok: Tokenizer) -> None:
    ids = tok.encode("Héllo 今天 world")
    r = post(url, "/detokenize", {"model": "tiny", "tokens": ids})
    assert r.json() == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"].startswith(tok.bos_token)  # special tokens kept, as vLLM


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
        ("/tokenize", {"model": "tiny"}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
         "prompt"),
        ("/tokenize", {"prompt": "word " * 100}, 400, "prompt"),  # beyond max_model_len
        ("/tokenize", {"prompt": "word " * 20000}, 400, "prompt"),  # the prompt guard's cut
        ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                       "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"},
         400, "chat_template"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/detokenize", {"tokens": [5, 99999]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [5] * 65}, 400, "tokens"),  # more than max_model_len
    ],
)  # fmt: skip
def test_tokenize_refusals(url: str, path: str, body: dict, status: int, param: str) -> None:
    r = post(url, path, body)
    assert (r.status_code, r.json()["error"]["param"]) == (status, param), r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_models_version_and_aliases(url: str, server: Served, tok: Tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias", "org/tiny"]
    card = httpx.get(f"{url}/v1/models/org/tiny").json()  # a name with a slash
    assert card == {"id": "org/tiny", "object": "model", "created": 0,
                    "owned_by": "pdserve", "root": "/models/tiny", "parent": None,
                    "max_model_len": 64}  # fmt: skip
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.code == "model_not_found"
    version = httpx.get(f"{url}/version").json()
    assert version == {"version": importlib.metadata.version("pdserve")}
    # an alias reaches the backend, and the response, as the served name
    out = client.completions.create(model="tiny-alias", prompt="Hi", max_tokens=4)
    assert (out.model, server.backend.submitted[-1].model) == ("tiny", "tiny")
    assert out.system_fingerprint == system_fingerprint(TINY)
    assert out.system_fingerprint.startswith(f"pdserve-{version['version']}-")


def test_continuous_usage_and_fingerprint_on_every_chunk(url: str, tok: Tokenizer) -> None:
    body = {"model": "tiny", "prompt": "Hi", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    events = sse(post(url, "/v1/completions", body))
    prompt_tokens = len(tok.encode("Hi"))
    completion_tokens = len(tok.encode("Hello world", False)) + 1  # and the eos
    text_chunks, last = events[:-1], events[-1]
    assert len(text_chunks) >= 2 and last["choices"] == []
    done = [e["usage"]["completion_tokens"] for e in text_chunks]
    assert done == sorted(done) and done[0] >= 1 and done[-1] == completion_tokens
    for e in events:
        assert e["system_fingerprint"] == system_fingerprint(TINY)
        assert e["usage"]["prompt_tokens"] == prompt_tokens
        assert e["usage"]["total_tokens"] == prompt_tokens + e["usage"]["completion_tokens"]
    assert last["usage"]["completion_tokens"] == completion_tokens
    body["stream_options"] = {"include_usage": True}  # plain include_usage: null until the end
    assert [e["usage"] for e in sse(post(url, "/v1/completions", body))[:-1]] == [None] * len(
        text_chunks
    )


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    events = [e[6:] for e in r.text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_developer_role_is_system_in_the_template(tok: Tokenizer) -> None:
    with serve_with(tok, template=TEMPLATE) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
        for role in ("developer", "system"):
            client.chat.completions.create(
                model="tiny",
                messages=[
                    {"role": role, "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                ],
            )
        text = "[system] Be brief.\n[user] Hi\n[assistant]"
        expected = tok.encode(text, add_special_tokens=False)
        assert [r.prompt_token_ids for r in s.backend.submitted] == [expected, expected]
        # /tokenize renders tools as the chat endpoint does (the function, without nulls)
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        messages = [{"role": "user", "content": "Hi"}]
        r = post(s.url, "/tokenize", {"messages": messages, "tools": [tool]})
        text = f"{json.dumps([tool])}\n[user] Hi\n[assistant]"
        assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
        r = post(s.url, "/tokenize", {"messages": messages, "tools": [{"type": "function"}]})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "tools[0].function")


def test_request_id_and_cors(tok: Tokenizer) -> None:
    origins = ("https://ui.example",)
    with serve_with(tok, api_keys=("sk-test",), allowed_origins=origins) as s:
        given = {"X-Request-Id": "trace-42", **KEY}
        r = post(s.url, "/v1/completions", {"model": "tiny", "prompt": "Hi"}, headers=given)
        assert (r.status_code, r.headers["x-request-id"]) == (200, "trace-42")
        refused = post(s.url, "/v1/completions", {"model": "tiny", "prompt": "Hi"})
        assert refused.status_code == 401  # the admission's refusals carry one too
        for r in (refused, httpx.get(f"{s.url}/health", headers={"X-Request-Id": "x" * 129})):
            assert re.fullmatch("[0-9a-f]{32}", r.headers["x-request-id"])
        # /tokenize takes the key like /v1/*; /version does not
        assert post(s.url, "/tokenize", {"prompt": "Hi"}).status_code == 401
        assert post(s.url, "/tokenize", {"prompt": "Hi"}, headers=KEY).status_code == 200
        assert httpx.get(f"{s.url}/version").status_code == 200
        # CORS: a preflight needs no key; only the allowed origin is echoed
        preflight = {"Origin": origins[0], "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
        r = httpx.options(f"{s.url}/v1/chat/completions", headers=preflight)
        assert (r.status_code, r.headers["access-control-allow-origin"]) == (200, origins[0])
        r = httpx.get(f"{s.url}/v1/models", headers={"Origin": origins[0], **KEY})
        assert r.headers["access-control-allow-origin"] == origins[0]
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        r = httpx.get(f"{s.url}/v1/models", headers={"Origin": "https://evil.example", **KEY})
        assert "access-control-allow-origin" not in r.headers
    with serve_with(tok) as s:  # no --allowed-origins: no CORS at all
        r = httpx.get(f"{s.url}/v1/models", headers={"Origin": origins[0]})
        assert "access-control-allow-origin" not in r.headers


def test_tokenize_bodies_are_bounded(tok: Tokenizer) -> None:
    with serve_with(tok, max_body_bytes=1000) as s:
        r = post(s.url, "/tokenize", {"prompt": "x" * 1000})
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
        r = httpx.post(f"{s.url}/detokenize", content=b"tokens=1", timeout=20)
        assert (r.status_code, r.json()["error"]["code"]) == (415, "unsupported_media_type")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"best_of": 2}, "best_of"),
        ({"n": 2, "best_of": 3}, "best_of"),
        ({"prompt_logprobs": 0, "n": 2}, "prompt_logprobs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"allowed_token_ids": [5]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"priority": 2**31}, "priority"),
        ({"cache_salt": "tenant"}, "cache_salt"),
        ({"return_token_ids": True}, "return_token_ids"),
        ({"echo": True}, "echo"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"documents": [{"text": "x"}]}, "documents"),
    ],
)
def test_fields_not_honoured_are_refused(url: str, server: Served, fields: dict, param: str):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}
    r = post(url, "/v1/chat/completions", body)
    assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    assert server.backend.submitted == []


def test_fields_accepted(url: str, server: Served, tok: Tokenizer) -> None:
    """Defaults, best_of equal to n, ignored fields and add_special_tokens: a 200 each."""
    fields = {"best_of": 2, "n": 2, "priority": -3, "prompt_logprobs": None, "bad_words": [],
              "use_beam_search": False, "user": "u1", "spaces_between_special_tokens": False,
              "add_special_tokens": False}  # fmt: skip
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hi", **fields})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    assert server.backend.submitted[-1].prompt_token_ids == tok.encode("Hi", False)  # no bos
    assert server.backend.submitted[-1].share == m.Share(
        tenant="default", tier=m.Tier.STANDARD, weight=1, priority=-3
    )
    body = {"model": "tiny", "prompt": "Hi", "n": 2, "best_of": 1}
    assert post(url, "/v1/completions", body).status_code == 200


@pytest.mark.parametrize("stop", [list("abcde"), "x" * 257, ["ok", "x" * 257], 5])
def test_stop_limit_message(url: str, stop: Any) -> None:
    r = post(url, "/v1/completions", {"model": "tiny", "prompt": "Hi", "stop": stop})
    assert (r.status_code, r.json()["error"]["message"]) == (400, STOP_LIMIT)
