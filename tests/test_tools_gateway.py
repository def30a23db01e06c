"""Tool calling through the gateway over real HTTP with the openai SDK, the model's output
scripted by the fake backend: parsed tool calls, streamed deltas, finish reasons, refusals."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.config import GatewayConfig
from pdserve.models.make_model import make_model
from tests.gateway_util import FakeBackend, Script, Served, served_model, serving_config

MODELS = [served_model(name, max_model_len=2048) for name in ("hermes", "llama3")]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, NOW]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
HERMES_OUT = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tool_models")
    return {t: Tokenizer.from_dir(make_model(root / t, template=t)) for t in ("hermes", "llama3")}


@pytest.fixture(scope="module")
def served(toks: dict[str, Tokenizer]) -> Iterator[Served]:
    with serving_config(FakeBackend(MODELS), toks, GatewayConfig()) as s:
        yield s


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)


def script(tok: Tokenizer, *texts: str, finish: str = "stop") -> Script:
    """Each text as one choice's tokens (ending with the eos when it finishes with "stop")."""
    eos = [tok.eos_token_ids[0]] if finish == "stop" else []
    return Script(
        [[*tok.encode(t, add_special_tokens=False), *eos] for t in texts], finish, decode_batch=2
    )


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def reassemble(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """Per choice: content, tool calls (by delta index), finish reason, from stream chunks."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            choice = out.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            choice["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = choice["calls"].setdefault(
                    d.index, {"id": None, "name": None, "arguments": ""}
                )
                if d.id is not None:
                    assert call["id"] is None and d.type == "function" and d.function.name
                    call.update(id=d.id, name=d.function.name)
                assert call["id"] is not None  # the first delta of a call carries its id
                call["arguments"] += d.function.arguments or ""
            choice["finish"] = c.finish_reason or choice["finish"]
    return out


def test_auto_hermes_streamed_equals_non_streamed(
    served: Served, toks: dict[str, Tokenizer]
) -> None:
    served.backend.reset(script(toks["hermes"], HERMES_OUT, "No tools needed."))
    api = client(served.url)
    full = api.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, n=2)
    first, second = full.choices
    assert (first.message.content, first.finish_reason) == ("Let me look.", "tool_calls")
    assert calls_of(first.message) == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert all(CALL_ID.fullmatch(c.id) and c.type == "function" for c in first.message.tool_calls)
    assert len({c.id for c in first.message.tool_calls}) == 2
    assert (second.message.content, second.message.tool_calls, second.finish_reason) == (
        "No tools needed.",
        None,
        "stop",
    )
    prompt = toks["hermes"].decode(served.backend.submitted[0].prompt_token_ids, False)
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    assert served.backend.submitted[0].sampling.structured is None  # auto: unconstrained

    chunks = list(
        api.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, n=2, stream=True)
    )
    streamed = reassemble(chunks)
    for index, choice in enumerate(full.choices):
        got = streamed[index]
        assert got["content"] == (choice.message.content or "")
        assert got["finish"] == choice.finish_reason
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == calls_of(
            choice.message
        )
        assert all(CALL_ID.fullmatch(c["id"]) for c in got["calls"].values())


def test_stream_chunks_in_openai_delta_format(served: Served, toks: dict[str, Tokenizer]) -> None:
    served.backend.reset(script(toks["hermes"], HERMES_OUT))
    body = {"model": "hermes", "messages": ASK, "tools": TOOLS, "stream": True}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=20)
    events = [json.loads(e[6:]) for e in r.text.strip().split("\n\n")[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant"
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert [len(c) for c in calls] == [1, 1]  # one call per chunk here, each whole
    head = calls[0][0]
    assert set(head) == {"index", "id", "type", "function"} and head["index"] == 0
    assert head["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[1][0]["index"] == 1 and calls[1][0]["function"]["name"] == "now"
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."


def test_auto_llama3_json_and_parser_flag(toks: dict[str, Tokenizer]) -> None:
    out = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    backend = FakeBackend(MODELS, script(toks["llama3"], out))
    with serving_config(backend, toks, GatewayConfig()) as s:
        full = client(s.url).chat.completions.create(model="llama3", messages=ASK, tools=TOOLS)
        assert (full.choices[0].message.content, full.choices[0].finish_reason) == (
            None,
            "tool_calls",
        )
        assert calls_of(full.choices[0].message) == [("get_weather", '{"city": "Paris"}')]
        backend.reset(script(toks["hermes"], out))  # the hermes model's template is no matter:
    with serving_config(backend, toks, GatewayConfig(tool_call_parser="llama3_json")) as s:
        full = client(s.url).chat.completions.create(model="hermes", messages=ASK, tools=TOOLS)
        assert calls_of(full.choices[0].message) == [("get_weather", '{"city": "Paris"}')]


def test_tool_choice_none_and_parallel_false(served: Served, toks: dict[str, Tokenizer]) -> None:
    api = client(served.url)
    served.backend.reset(script(toks["hermes"], HERMES_OUT))
    plain = api.chat.completions.create(
        model="hermes", messages=ASK, tools=TOOLS, tool_choice="none"
    )
    assert (plain.choices[0].message.content, plain.choices[0].finish_reason) == (
        HERMES_OUT,
        "stop",
    )
    assert "<tools>" in toks["hermes"].decode(served.backend.submitted[0].prompt_token_ids, False)
    one = api.chat.completions.create(
        model="hermes", messages=ASK, tools=TOOLS, parallel_tool_calls=False
    )
    assert calls_of(one.choices[0].message) == [("get_weather", '{"city": "Paris"}')]


def test_constrained_output_becomes_tool_calls(served: Served, toks: dict[str, Tokenizer]) -> None:
    api = client(served.url)
    named = {"type": "function", "function": {"name": "get_weather"}}
    served.backend.reset(script(toks["hermes"], '{"city": "Paris"}'))
    full = api.chat.completions.create(model="hermes", messages=ASK, tools=TOOLS, tool_choice=named)
    assert calls_of(full.choices[0].message) == [("get_weather", '{"city": "Paris"}')]
    assert (full.choices[0].message.content, full.choices[0].finish_reason) == (None, "tool_calls")
    chunks = list(
        api.chat.completions.create(
            model="hermes", messages=ASK, tools=TOOLS, tool_choice=named, stream=True
        )
    )
    [call] = reassemble(chunks)[0]["calls"].values()
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Paris"}')
    args = [d.function.arguments for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert len(args) > 2  # the arguments stream as they come

    array = json.dumps(
        [{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]
    )
    served.backend.reset(script(toks["hermes"], array))
    full = api.chat.completions.create(
        model="hermes", messages=ASK, tools=TOOLS, tool_choice="required"
    )
    assert calls_of(full.choices[0].message) == [("now", "{}"), ("get_weather", '{"city": "Rome"}')]
    assert full.choices[0].finish_reason == "tool_calls"

    served.backend.reset(script(toks["hermes"], '{"city": "Par', finish="length"))
    cut = api.chat.completions.create(
        model="hermes", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=3
    )
    assert cut.choices[0].finish_reason == "length"
    assert calls_of(cut.choices[0].message)[0][0] == "get_weather"


def test_constraint_reaches_the_worker(served: Served, toks: dict[str, Tokenizer]) -> None:
    """The sampling parameters the worker gets carry the JSON schema of the tool choice,
    written out here by hand (vLLM's form, not the product's function). That the worker
    then holds the output to it is seen in test_tools_e2e: a random model's named and
    required calls validate."""

    def call(name: str, parameters: dict) -> dict:
        return {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }

    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    required = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [call("get_weather", weather), call("now", {"type": "object"})]},
    }
    api = client(served.url)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel, want in (
        ("required", None, required),
        ("required", False, {**required, "maxItems": 1}),
        (named, None, weather),
    ):
        served.backend.reset(script(toks["hermes"], "[]"))
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        api.chat.completions.create(
            model="hermes", messages=ASK, tools=TOOLS, tool_choice=choice, **extra
        )
        [sent] = served.backend.submitted
        assert sent.sampling.structured.kind == "json"
        assert json.loads(sent.sampling.structured.spec) == want


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "tool_choice requires tools"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls", "only allowed when tools are given"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "`x`, not in tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
         "should match pattern"),
        ({"tools": TOOLS, "messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{x"}}]}]},
         "messages[0].tool_calls[0].function.arguments", "is not valid JSON"),
    ],
)  # fmt: skip
def test_refusals_are_400s(served: Served, fields: dict, param: str, message: str) -> None:
    body = {"model": "hermes", "messages": ASK, **fields}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_history_with_tool_calls_is_rendered(served: Served, toks: dict[str, Tokenizer]) -> None:
    served.backend.reset(script(toks["hermes"], "It is 18 C."))
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]  # fmt: skip
    out = client(served.url).chat.completions.create(model="hermes", messages=history, tools=TOOLS)
    assert (
        out.choices[0].message.content == "It is 18 C." and out.choices[0].finish_reason == "stop"
    )
    prompt = toks["hermes"].decode(served.backend.submitted[0].prompt_token_ids, False)
    assert prompt.endswith(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_without_tools_refuses_them(toks: dict[str, Tokenizer], tmp_path: Path) -> None:
    plain = {"hermes": Tokenizer.from_dir(make_model(tmp_path / "plain", template="chatml"))}
    with serving_config(FakeBackend(MODELS), plain, GatewayConfig()) as s:
        r = httpx.post(
            f"{s.url}/v1/chat/completions",
            json={"model": "hermes", "messages": ASK, "tools": TOOLS},
            timeout=20,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "does not render tools" in r.json()["error"]["message"]
