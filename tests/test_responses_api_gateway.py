"""``POST /v1/responses`` through the gateway over real HTTP (uvicorn on loopback), the model's
output scripted by the fake backend (a test double for the ZMQ client): the response body, the
exact streamed event sequence, tool calls both ways, the prompt (the very one a chat request
sends), refusals, a failure after the first byte, and the tenant's limits."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.app import create_app
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.tenancy.core import Tenancy
from pdserve.gateway.tenancy.limiter_store import MemoryStore
from pdserve.gateway.tenancy.ratelimit import RateLimiter
from pdserve.gateway.tenancy.tenants import TenantsFile, hash_key
from pdserve.protocol.messages import StructuredSpec
from pdserve.protocol.tenancy import Share, Tier
from tests.gateway_util import FakeBackend, Script, Served, running_server, served_model
from tests.gateway_util import serving_config as serving
from tests.test_gateway_hardening_fuzz import fuzz

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER},
    {"type": "function", "name": "now", "parameters": {"type": "object"}},
]
HERMES_OUT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
HEX = "[0-9a-f]{32}"
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added"]
MESSAGE_DONE = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def served(tok: Tokenizer) -> Iterator[Served]:
    backend = FakeBackend([served_model("tiny", max_model_len=2048)])
    with serving(backend, {"tiny": tok}, GatewayConfig()) as s:
        yield s


def script(tok: Tokenizer, text: str, finish: str = "stop", **kw: Any) -> Script:
    """``text`` as the choice's tokens (then the eos when it finishes with "stop")."""
    eos = [tok.eos_token_ids[0]] if finish == "stop" else []
    return Script([[*tok.encode(text, add_special_tokens=False), *eos]], finish, **kw)


def post(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/responses", json={"model": "tiny", **body}, timeout=30)


def events_of(r: httpx.Response) -> list[dict[str, Any]]:
    """The SSE body's events, each ``event: <type>`` line checked against its data's type and
    the data against the SDK's event types; sequence numbers 0, 1, 2..."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.endswith("\n\n") and "[DONE]" not in r.text
    out = []
    for block in r.text.split("\n\n")[:-1]:
        head, data = block.split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == f"event: {body['type']}"
        EVENTS.validate_python(body)
        out.append(body)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def without_ids(value: Any) -> Any:
    """``value`` with every id and time left out: two runs of one request compare equal."""
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    if isinstance(value, dict):
        drop = {"id", "item_id", "call_id", "created_at", "completed_at"}
        return {k: without_ids(v) for k, v in value.items() if k not in drop}
    return value


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)


def test_a_text_response(served: Served, tok: Tokenizer) -> None:
    served.backend.reset(script(tok, "Hello world"))
    r = post(served.url, input="Hi", instructions="Be brief.", max_output_tokens=20,
             metadata={"k": "v"}, temperature=0)  # fmt: skip
    assert r.status_code == 200
    body = r.json()
    [request] = served.backend.submitted
    prompt = tok.encode_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert request.prompt_token_ids == prompt and request.request_id == body["id"]
    assert (request.sampling.max_tokens, request.sampling.temperature) == (20, 0.0)
    assert re.fullmatch(f"resp_{HEX}", body["id"])
    assert re.fullmatch(f"msg_{HEX}", body["output"][0]["id"])
    assert body["created_at"] <= body["completed_at"]
    outputs = len(tok.encode("Hello world", add_special_tokens=False)) + 1  # the eos counts
    assert without_ids(body) == {
        "object": "response", "status": "completed", "background": False, "error": None,
        "incomplete_details": None, "instructions": "Be brief.", "max_output_tokens": 20,
        "max_tool_calls": None, "model": "tiny",
        "output": [{"type": "message", "status": "completed", "role": "assistant", "content": [
            {"type": "output_text", "text": "Hello world", "annotations": [], "logprobs": []}]}],
        "parallel_tool_calls": True, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "store": False, "temperature": 0.0,
        "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
        "top_logprobs": 0, "top_p": 1.0, "truncation": "disabled",
        "usage": {"input_tokens": len(prompt),
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": outputs, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": len(prompt) + outputs},
        "user": None, "metadata": {"k": "v"},
    }  # fmt: skip
    assert Response.model_validate(body).output_text == "Hello world"
    sdk = api(served.url).responses.create(model="tiny", input="Hi", instructions="Be brief.")
    assert (sdk.output_text, sdk.status, sdk.usage and sdk.usage.total_tokens) == (
        "Hello world",
        "completed",
        len(prompt) + outputs,
    )


def test_the_streamed_events_in_order(served: Served, tok: Tokenizer) -> None:
    served.backend.reset(script(tok, "Hello world"))
    full = post(served.url, input="Hi").json()
    events = events_of(post(served.url, input="Hi", stream=True))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == "Hello world"
    assert types(events) == [
        "response.created",
        "response.in_progress",
        *MESSAGE_EVENTS,
        *["response.output_text.delta"] * len(deltas),
        *MESSAGE_DONE,
        "response.completed",
    ]
    created, in_progress, final = events[0]["response"], events[1]["response"], events[-1]
    assert created == in_progress and (created["status"], created["output"]) == ("in_progress", [])
    assert created["usage"] is None and created["id"] == final["response"]["id"]
    assert without_ids(final["response"]) == without_ids(full)  # the collected body
    item = final["response"]["output"][0]
    assert all(e.get("item_id", item["id"]) == item["id"] for e in events[2:-1])
    assert events[-2] == {"type": "response.output_item.done", "sequence_number": len(events) - 2,
                          "output_index": 0, "item": item}  # fmt: skip
    with api(served.url).responses.stream(model="tiny", input="Hi") as stream:
        sdk_deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final_response = stream.get_final_response()
    assert "".join(sdk_deltas) == final_response.output_text == "Hello world"


def test_max_output_tokens_leaves_it_incomplete(served: Served, tok: Tokenizer) -> None:
    served.backend.reset(script(tok, "Hello world, and more", finish="length"))
    body = post(served.url, input="Hi", max_output_tokens=3).json()
    assert (body["status"], body["incomplete_details"]) == (
        "incomplete",
        {"reason": "max_output_tokens"},
    )
    assert body["output"][0]["status"] == "incomplete" and body["usage"]["output_tokens"] == 3
    assert body["completed_at"] is None
    events = events_of(post(served.url, input="Hi", max_output_tokens=3, stream=True))
    assert events[-1]["type"] == "response.incomplete"
    assert without_ids(events[-1]["response"]) == without_ids(body)


def test_tool_calls_auto(served: Served, tok: Tokenizer) -> None:
    served.backend.reset(script(tok, HERMES_OUT, decode_batch=2))
    body = post(served.url, input="Weather in Paris, and the time?", tools=TOOLS).json()
    assert served.backend.submitted[0].sampling.structured is None  # auto: unconstrained
    message, weather, now = body["output"]
    assert message["content"][0]["text"] == "Let me look."
    assert [(c["type"], c["name"], c["arguments"], c["status"]) for c in (weather, now)] == [
        ("function_call", "get_weather", '{"city": "Paris"}', "completed"),
        ("function_call", "now", "{}", "completed"),
    ]
    assert all(re.fullmatch(f"fc_{HEX}", c["id"]) for c in (weather, now))
    assert all(re.fullmatch(f"call_{HEX}", c["call_id"]) for c in (weather, now))
    assert body["status"] == "completed" and body["tool_choice"] == "auto"
    assert body["tools"] == [{**t, "description": None, "strict": None} for t in TOOLS]
    events = events_of(
        post(served.url, input="Weather in Paris, and the time?", tools=TOOLS, stream=True)
    )
    text_deltas = types(events).count("response.output_text.delta")
    call = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert types(events) == [
        "response.created", "response.in_progress", *MESSAGE_EVENTS,
        *["response.output_text.delta"] * text_deltas, *MESSAGE_DONE, *call, *call,
        "response.completed",
    ]  # fmt: skip
    assert without_ids(events[-1]["response"]) == without_ids(body)
    parsed = Response.model_validate(events[-1]["response"])
    assert [o.type for o in parsed.output] == ["message", "function_call", "function_call"]


def test_a_fed_back_call_renders_the_prompt_a_chat_request_does(
    served: Served, tok: Tokenizer
) -> None:
    served.backend.reset(script(tok, "It is 18 C."))
    arguments = '{"city": "Paris"}'
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"},
    ]  # fmt: skip
    body = post(served.url, input=items, tools=TOOLS[:1]).json()
    assert Response.model_validate(body).output_text == "It is 18 C."
    chat = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1",
             "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
    }  # fmt: skip
    r = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 200
    mine, theirs = served.backend.submitted
    assert mine.prompt_token_ids == theirs.prompt_token_ids
    prompt = tok.decode(mine.prompt_token_ids, False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt


def test_a_named_tool_choice_is_constrained(served: Served, tok: Tokenizer) -> None:
    served.backend.reset(script(tok, '{"city": "Paris"}'))
    choice = {"type": "function", "name": "get_weather"}
    body = post(served.url, input="Weather?", tools=TOOLS, tool_choice=choice).json()
    spec = served.backend.submitted[0].sampling.structured
    assert spec == StructuredSpec("json", json.dumps(WEATHER))
    [call] = body["output"]
    assert (call["type"], call["name"], call["arguments"]) == (
        "function_call",
        "get_weather",
        '{"city": "Paris"}',
    )
    assert body["tool_choice"] == choice
    events = events_of(
        post(served.url, input="Weather?", tools=TOOLS, tool_choice=choice, stream=True)
    )
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == '{"city": "Paris"}'
    assert without_ids(events[-1]["response"]) == without_ids(body)


def test_text_format_json_schema_reaches_the_worker(served: Served, tok: Tokenizer) -> None:
    served.backend.reset(script(tok, '{"city": "Rome"}'))
    fmt = {"type": "json_schema", "name": "place", "schema": WEATHER, "strict": True}
    body = post(served.url, input="A city?", text={"format": fmt}).json()
    assert served.backend.submitted[0].sampling.structured == StructuredSpec(
        "json", json.dumps(WEATHER)
    )
    assert body["text"] == {"format": fmt}
    assert json.loads(Response.model_validate(body).output_text) == {"city": "Rome"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
        ({"extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0].type"),
        ({"max_output_tokens": 5000}, "input"),
        ({"model": "nope"}, "model"),
    ],
)  # fmt: skip
def test_refusals_are_openai_errors(served: Served, fields: dict[str, Any], param: str) -> None:
    before = served.metrics.requests.total(outcome="invalid")
    with pytest.raises(openai.APIStatusError) as caught:
        api(served.url).responses.create(**{"model": "tiny", "input": "Hi", **fields})
    error = caught.value
    assert error.status_code == (404 if param == "model" else 400)
    assert isinstance(error.body, dict) and error.body["param"] == param
    assert served.metrics.requests.total(outcome="invalid") == before + 1


def test_a_failure_after_the_first_byte(served: Served, tok: Tokenizer) -> None:
    served.backend.reset(script(tok, "Hello world", fail_after=2))
    events = events_of(post(served.url, input="Hi", stream=True))
    error, failed = events[-2:]
    assert error == {"type": "error", "sequence_number": len(events) - 2,
                     "code": "internal_error", "message": "decode worker died",
                     "param": None}  # fmt: skip
    response = failed["response"]
    assert (failed["type"], response["status"]) == ("response.failed", "failed")
    assert response["error"] == {"code": "server_error", "message": "decode worker died"}
    assert response["output"][0]["status"] == "in_progress"
    assert types(events)[:5] == ["response.created", "response.in_progress", *MESSAGE_EVENTS,
                                 "response.output_text.delta"]  # fmt: skip
    r = post(served.url, input="Hi")
    assert (r.status_code, r.json()["error"]["message"]) == (500, "decode worker died")
    served.backend.reset(script(tok, "Hi", reject_status=503))
    r = post(served.url, input="Hi", stream=True)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


TENANTS = """
[tenants.acme]
requests_per_minute = 2
tokens_per_minute = 1000
max_tokens = 50
keys = ["{key}"]
"""


def test_the_tenant_limits_apply(tok: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "tenants.toml").write_text(TENANTS.format(key=hash_key("sk-acme")), "utf-8")
    limiter = RateLimiter(MemoryStore(clock=lambda: 1000.0))
    tenancy = Tenancy(TenantsFile(tmp_path / "tenants.toml"), limiter=limiter)
    backend = FakeBackend([served_model("tiny", 2048)], script(tok, "ok"))
    app = create_app(backend, {"tiny": tok}, config=GatewayConfig(), tenancy=tenancy)
    key = {"Authorization": "Bearer sk-acme"}
    with running_server(app) as url:

        def send(**body: Any) -> httpx.Response:
            payload = {"model": "tiny", "input": "Hi", **body}
            return httpx.post(f"{url}/v1/responses", json=payload, headers=key, timeout=30)

        assert httpx.post(f"{url}/v1/responses", json={"input": "Hi"}).status_code == 401
        over = send(max_output_tokens=51)
        assert (over.status_code, over.json()["error"]["param"]) == (400, "max_output_tokens")
        first = send(max_output_tokens=10)
        prompt = first.json()["usage"]["input_tokens"]
        assert first.headers["x-ratelimit-remaining-tokens"] == str(1000 - prompt - 10)
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert backend.submitted[0].share == Share(tenant="acme", tier=Tier.STANDARD, weight=1)
        assert send(stream=True).status_code == 200
        assert backend.submitted[1].sampling.max_tokens == 50  # the key's cap
        refused = send()
        assert (
            refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        )
    tenancy.close()


def test_schemathesis_finds_no_5xx(tok: Tokenizer) -> None:
    """Positive and negative bodies from the served OpenAPI schema of ``/v1/responses``
    (test_gateway_hardening_fuzz's way): no 5xx, every refusal an OpenAI error body."""
    backend = FakeBackend([served_model("tiny", 4096)], Script([[5, 6, 7]]))
    with running_server(create_app(backend, {"tiny": tok})) as url:
        statuses = fuzz(url, "/v1/responses", 120)
    # the bodies were meaningful: some reached the backend (items are loose in the schema:
    # most generated ones lack what their type needs), many were refused
    assert statuses[200] >= 10 and statuses[400] >= 20, statuses
    assert set(statuses) <= {200, 400, 404, 415}, statuses
