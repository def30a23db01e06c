"""Tool calling end to end: ``pdserve serve`` 1P1D on the random model (its default template
renders tools in the Qwen/Hermes style), the openai client. Named and required calls are
constrained, so their arguments validate whatever the weights; streamed tool-call deltas add
up to the non-streamed message; a conversation carrying tool calls and results is rendered."""

from __future__ import annotations

import json
from typing import Any

import jsonschema_rs
import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.openai_models import ChatCompletionRequest
from tests.e2e_util import ServedCluster

# bounded schemas: a random model cannot run a constrained call past max_tokens
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Köln"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
ALERT = {
    "type": "object",
    "properties": {"level": {"enum": ["low", "high"]}},
    "required": ["level"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alert", "parameters": ALERT}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alert": ALERT}
CITY = {  # for the real model: free text it must end by itself
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    c = ServedCluster(tiny_dir, "--num-kv-blocks=512")
    yield c
    c.stop()


def chat(c: ServedCluster, stream: bool = False, **kw: Any) -> dict[str, Any]:
    """The message as {content, calls: [(id, name, arguments)], finish}, streamed or not."""
    api = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)
    body = {"model": c.model_name, "messages": ASK, "tools": TOOLS, "max_tokens": 120, **kw}
    body.setdefault("temperature", 0)
    if not stream:
        choice = api.chat.completions.create(**body).choices[0]
        calls = [
            (t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls or []
        ]
        return {"content": choice.message.content, "calls": calls, "finish": choice.finish_reason}
    content, calls, finish = "", {}, None
    for chunk in api.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.id is not None:
                    calls[d.index] = [d.id, d.function.name, ""]
                calls[d.index][2] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return {
        "content": content or None,
        "calls": [tuple(c) for c in calls.values()],
        "finish": finish,
    }


def check_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """Every call's arguments parse and validate against its function's schema."""
    out = []
    for _, name, arguments in message["calls"]:
        args = json.loads(arguments)
        jsonschema_rs.validate(SCHEMAS[name], args)
        out.append(args)
    return out


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    strip = [(name, args) for _, name, args in a["calls"]], [(n, x) for _, n, x in b["calls"]]
    return strip[0] == strip[1] and (a["content"], a["finish"]) == (b["content"], b["finish"])


def test_named_call_validates_and_streams_the_same(cluster) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = chat(cluster, tool_choice=named)
    assert full["finish"] == "tool_calls" and full["content"] is None
    assert [name for _, name, _ in full["calls"]] == ["get_weather"]
    assert check_calls(full)[0]["city"] in ("Paris", "Rome", "Köln")
    assert same_message(chat(cluster, stream=True, tool_choice=named), full)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_validate_and_stream_the_same(cluster, parallel: bool) -> None:
    full = chat(cluster, tool_choice="required", parallel_tool_calls=parallel, max_tokens=300)
    # a random model may call on and on: then the calls made before the cut still validate
    assert full["finish"] in (("tool_calls", "length") if parallel else ("tool_calls",))
    assert full["content"] is None or full["finish"] == "length"
    assert 1 <= len(check_calls(full)) <= (100 if parallel else 1)
    streamed = chat(
        cluster, stream=True, tool_choice="required", parallel_tool_calls=parallel, max_tokens=300
    )
    assert same_message(streamed, full)
    assert len({call_id for call_id, _, _ in full["calls"]}) == len(full["calls"])


def test_colocated_gives_the_same_calls(cluster, tiny_dir) -> None:
    """Greedy constrained calls are the same whether prefill and decode run apart or not."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    coloc = ServedCluster(tiny_dir, "--num-kv-blocks=512", "--mode=colocated")
    try:
        for kw in ({"tool_choice": named}, {"tool_choice": "required", "max_tokens": 300}):
            assert same_message(chat(coloc, **kw), chat(cluster, **kw)), kw
            assert same_message(chat(coloc, stream=True, **kw), chat(cluster, **kw)), kw
    finally:
        coloc.stop()


def test_auto_streamed_equals_non_streamed(cluster) -> None:
    for seed in (1, 2, 3):
        kw = {"temperature": 1.0, "seed": seed, "max_tokens": 40}
        assert same_message(chat(cluster, stream=True, **kw), chat(cluster, **kw))


def test_tool_history_is_rendered(cluster, tiny_dir) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "metric": true}'}
    messages = [
        *ASK,
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C and sunny"},
    ]  # fmt: skip
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0)
    out = api.chat.completions.create(
        model=cluster.model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    body = {"model": "m", "messages": messages, "tools": TOOLS}
    req = ChatCompletionRequest.model_validate(body)
    tok = Tokenizer.from_dir(tiny_dir)
    prompt = tok.encode_chat(req.template_messages(), tools=TOOLS)
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in tok.decode(prompt, False)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)
    assert (
        out.choices[0].finish_reason in ("stop", "length") and not out.choices[0].message.tool_calls
    )


def test_real_model_named_and_required_calls(real_tools_dir) -> None:
    c = ServedCluster(real_tools_dir, "--mode=disagg", ready_timeout=180)
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        for kw in (
            {"tool_choice": named},
            {"tool_choice": "required", "parallel_tool_calls": False},
        ):
            full = chat(c, tools=tools, max_tokens=60, **kw)
            assert full["finish"] == "tool_calls" and full["content"] is None, full
            [(_, name, arguments)] = full["calls"]
            assert name == "get_weather"
            jsonschema_rs.validate(CITY, json.loads(arguments))
            assert same_message(chat(c, stream=True, tools=tools, max_tokens=60, **kw), full)
    finally:
        c.stop()
