"""Tool fields of a chat request: validation, template inputs, output plan and constraints."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema_rs
import pytest

from pdserve.engine.grammar import grammar_text
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.config import GatewayConfig, config_from_args
from pdserve.gateway.errors import OpenAIError, from_validation
from pdserve.gateway.jobs import prepare_chat
from pdserve.gateway.main import add_gateway_args
from pdserve.gateway.openai_models import ChatCompletionRequest, check_supported
from pdserve.gateway.structured import required_schema, tool_choice_constraint
from pdserve.gateway.tools.request import ToolPlan, template_features, tool_plan
from pdserve.launch.serve import add_serve_args
from pdserve.launch.serve_api import gateway_api_flags
from pdserve.models.make_model import add_make_model_args, make_model, run_make_model
from tests.gateway_util import served_model
from tests.test_gateway_requests import validation_error

MODEL = served_model("tiny", max_model_len=2048)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["C", "F"]},
                "where": {"$ref": "#/$defs/Place"},
            },
            "required": ["city"],
            "$defs": {"Place": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, NOW]


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def fn_call(id: str, name: str, arguments: object) -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def refusal(**fields: object) -> tuple[str | None, str]:
    with pytest.raises(OpenAIError) as info:
        check_supported(chat(**fields))
    assert info.value.status == 400
    return info.value.param, info.value.message


@pytest.fixture(scope="module")
def toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tool_templates")
    return {
        t: Tokenizer.from_dir(make_model(root / t, template=t))
        for t in ("chatml", "hermes", "llama3")
    }


def test_refusals() -> None:
    assert refusal(tool_choice="auto") == ("tool_choice", "tool_choice requires tools")
    assert refusal(tool_choice="required", tools=[]) == (
        "tool_choice",
        "tool_choice requires tools",
    )
    assert refusal(parallel_tool_calls=False)[0] == "parallel_tool_calls"
    named = {"type": "function", "function": {"name": "nope"}}
    assert refusal(tools=TOOLS, tool_choice=named) == (
        "tool_choice",
        "tool_choice names the function `nope`, not in tools",
    )
    assert refusal(tools=[WEATHER, WEATHER]) == (
        "tools[1].function.name",
        "two tools are named `get_weather`",
    )
    huge = {
        "type": "function",
        "function": {"name": "big", "parameters": {"description": "x" * 70000}},
    }
    assert refusal(tools=[huge])[0] == "tools[0].function.parameters"
    check_supported(chat(tool_choice="none"))  # "none" without tools: nothing to do
    check_supported(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [tool("bad name")]}, "tools[0].function.name"),
        ({"tools": [tool("x" * 65)]}, "tools[0].function.name"),
        ({"tools": [NOW] * 129}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
         "messages[0].tool_calls[0].function.name"),
    ],
)  # fmt: skip
def test_shape_errors_are_400s(fields: dict, param: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    error = from_validation(validation_error(ChatCompletionRequest, body))
    assert (error.status, error.param) == (400, param)


def test_template_messages_parse_arguments() -> None:
    req = chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    fn_call("c1", "get_weather", '{"city": "Köln"}'),
                    fn_call("c2", "now", ""),
                    fn_call("c3", "now", {"tz": "UTC"}),
                ],
            },
            {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
        ]
    )  # fmt: skip
    assert req.template_messages()[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                fn_call("c1", "get_weather", {"city": "Köln"}),
                fn_call("c2", "now", {}),
                fn_call("c3", "now", {"tz": "UTC"}),
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
    ]  # fmt: skip
    for arguments, why in (("{nope", "is not valid JSON"), ("[1]", "must be a JSON object")):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        bad = chat(messages=[{"role": "assistant", "tool_calls": [call]}])
        with pytest.raises(OpenAIError, match=why) as info:
            bad.template_messages()
        assert info.value.param == "messages[0].tool_calls[0].function.arguments"


def test_template_features(toks: dict[str, Tokenizer]) -> None:
    hermes, llama3, plain = (
        toks[t].template_for([WEATHER]) for t in ("hermes", "llama3", "chatml")
    )
    assert template_features(hermes) == template_features(hermes).__class__(True, True, "hermes")
    assert (template_features(llama3).parser, template_features(llama3).renders_tools) == (
        "llama3_json",
        True,
    )
    assert template_features(plain) == template_features(plain).__class__(False, False, None)


def test_tool_plan(toks: dict[str, Tokenizer]) -> None:
    hermes = toks["hermes"].template_for([WEATHER])
    assert tool_plan(chat(tools=TOOLS), hermes) == ToolPlan("auto", parser="hermes")
    assert tool_plan(chat(tools=TOOLS), hermes, "llama3_json") == ToolPlan(
        "auto", parser="llama3_json"
    )
    assert tool_plan(chat(tools=TOOLS, tool_choice="none"), hermes) is None
    assert tool_plan(chat(), hermes) is None
    single = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert tool_plan(single, hermes) == ToolPlan("required", parallel=False)
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert tool_plan(named, hermes) == ToolPlan("named", name="now")
    plain = toks["chatml"].template_for([WEATHER])
    with pytest.raises(OpenAIError, match="does not render tools"):
        tool_plan(chat(tools=TOOLS, tool_choice="required"), plain)
    assert tool_plan(chat(tools=TOOLS, tool_choice="none"), plain) is None
    no_format = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"
    with pytest.raises(OpenAIError, match="--tool-call-parser hermes or llama3_json"):
        tool_plan(chat(tools=TOOLS), no_format)
    assert tool_plan(chat(tools=TOOLS), no_format, "hermes") == ToolPlan("auto", parser="hermes")


def test_prepare_chat(toks: dict[str, Tokenizer]) -> None:
    job = prepare_chat(chat(tools=TOOLS), toks["hermes"], MODEL)
    assert (job.tools, job.skip_special_tokens) == (ToolPlan("auto", parser="hermes"), True)
    prompt = toks["hermes"].decode(job.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert prepare_chat(chat(tools=TOOLS, tool_choice="none"), toks["hermes"], MODEL).tools is None
    with pytest.raises(OpenAIError, match="does not render tools") as info:
        prepare_chat(chat(tools=TOOLS), toks["chatml"], MODEL)
    assert (info.value.status, info.value.param) == (400, "tools")
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    history = chat(
        messages=[{"role": "user", "content": "t?"}, {"role": "assistant", "tool_calls": [call]}]
    )
    with pytest.raises(OpenAIError, match="does not render tool_calls") as info:
        prepare_chat(history, toks["chatml"], MODEL)
    assert info.value.param == "messages[1].tool_calls"
    assert prepare_chat(history, toks["llama3"], MODEL).tools is None


def validator(spec_text: str) -> jsonschema_rs.Validator:
    return jsonschema_rs.validator_for(json.loads(spec_text))


def test_named_constraint() -> None:
    spec = tool_choice_constraint(
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert spec is not None and spec.kind == "json"
    assert json.loads(spec.spec) == WEATHER["function"]["parameters"]
    v = validator(spec.spec)
    assert v.is_valid({"city": "Paris", "unit": "C", "where": {"lat": 1.5}})
    assert not v.is_valid({"unit": "C"}) and not v.is_valid({"city": "P", "where": {"lat": "x"}})
    grammar_text(spec)  # the engine compiles it
    now = tool_choice_constraint(
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    )
    assert now is not None and json.loads(now.spec) == {"type": "object", "properties": {}}


def test_required_constraint() -> None:
    spec = tool_choice_constraint(chat(tools=TOOLS, tool_choice="required"))
    assert spec is not None and spec.kind == "json"
    v = validator(spec.spec)
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris", "where": {"lat": 2}}},
        {"name": "now", "parameters": {}},
    ]
    assert v.is_valid(good)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {}}],  # city missing
        [{"name": "get_weather", "parameters": {"city": "P", "where": {"lat": "north"}}}],  # $ref
        [{"name": "nope", "parameters": {}}],
        [{"name": "now", "parameters": {}, "extra": 1}],
        {"name": "now", "parameters": {}},
    ):
        assert not v.is_valid(bad), bad
    grammar_text(spec)
    single = tool_choice_constraint(
        chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    )
    assert single is not None
    assert validator(single.spec).is_valid(good[1:]) and not validator(single.spec).is_valid(good)
    assert json.loads(single.spec) == required_schema(chat(tools=TOOLS).tools or [], parallel=False)
    for choice in (None, "none", "auto"):
        assert tool_choice_constraint(chat(tools=TOOLS, tool_choice=choice)) is None
    assert tool_choice_constraint(chat()) is None


def test_required_schema_rebases_refs_only_where_schemas_are() -> None:
    params = {
        "type": "object",
        "properties": {
            "default": {"$ref": "#/$defs/N"},  # a property named like a keyword: a schema
            "tag": {"const": {"$ref": "#/kept"}, "default": {"$ref": "#/kept"}},  # values
        },
        "$defs": {"N": {"type": "integer"}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    schema = required_schema(chat(tools=[tool]).tools or [])
    rebased = schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert rebased["properties"]["default"] == {
        "$ref": "#/items/anyOf/0/properties/parameters/$defs/N"
    }
    assert rebased["properties"]["tag"] == params["properties"]["tag"]
    v = jsonschema_rs.validator_for(schema)
    assert v.is_valid([{"name": "f", "parameters": {"default": 3}}])
    assert not v.is_valid([{"name": "f", "parameters": {"default": "three"}}])
    assert params["properties"]["default"] == {"$ref": "#/$defs/N"}  # the request's is untouched


def test_make_model_template_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown template 'mistral'"):
        make_model(tmp_path, template="mistral")
    parser = argparse.ArgumentParser()
    add_make_model_args(parser)
    assert parser.parse_args(["--out=x"]).template == "hermes"
    assert run_make_model(parser.parse_args([f"--out={tmp_path / 'm'}", "--template=llama3"])) == 0
    template = Tokenizer.from_dir(tmp_path / "m").template_for([WEATHER])
    assert template_features(template).parser == "llama3_json"


def test_tool_call_parser_flag(tmp_path: Path) -> None:
    gateway = argparse.ArgumentParser()
    add_gateway_args(gateway)
    base = ["--coordinator=tcp://127.0.0.1:1"]
    assert config_from_args(gateway.parse_args(base)).tool_call_parser == "auto"
    flags = [*base, "--tool-call-parser=llama3_json", "--enable-auto-tool-choice"]
    assert config_from_args(gateway.parse_args(flags)).tool_call_parser == "llama3_json"
    with pytest.raises(SystemExit):
        gateway.parse_args([*base, "--tool-call-parser=mistral"])
    with pytest.raises(ValueError, match="tool call parser must be one of auto, hermes"):
        GatewayConfig(tool_call_parser="pythonic")
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    args = serve.parse_args(
        ["--model=tiny", "--tool-call-parser=hermes", "--enable-auto-tool-choice"]
    )
    assert gateway_api_flags(args, tmp_path) == ["--tool-call-parser=hermes"]
    assert gateway_api_flags(serve.parse_args(["--model=tiny"]), tmp_path) == []
