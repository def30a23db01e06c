"""The Responses API's plain functions (``gateway.responses_api``): a request as the chat request
it stands for, what is refused (the ``param`` each 400 names), the ``Job`` it becomes, the
output items and events a choice's updates make, and the ``response`` object, checked against
the openai SDK's own types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.choices import ChoiceUpdate
from pdserve.gateway.errors import OpenAIError
from pdserve.gateway.jobs import prepare_chat
from pdserve.gateway.openai_models import ChatCompletionRequest
from pdserve.gateway.responses_api.models import ResponsesRequest
from pdserve.gateway.responses_api.output import (
    OutputItems,
    echo,
    final_status,
    response_json,
    usage_json,
)
from pdserve.gateway.responses_api.translate import (
    chat_messages,
    chat_request,
    check_output_tokens,
    prepare_response,
    responses_param,
)
from pdserve.gateway.run import Usage
from pdserve.gateway.tenancy.tenants import Tenant
from pdserve.gateway.tools.calls import ToolCallDelta
from pdserve.protocol.messages import StructuredSpec
from tests.gateway_util import served_model

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": WEATHER}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "tiny", **fields})


def refusal(**fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        chat_request(request(**fields))
    assert caught.value.status == 400
    return caught.value


def counter() -> Any:
    """Ids ``msg_1``, ``fc_2``, ``call_3``...: one count across prefixes."""
    n = iter(range(1, 1000))
    return lambda prefix: f"{prefix}_{next(n)}"


def test_instructions_and_a_string_input_are_system_then_user() -> None:
    req = request(input="Hi", instructions="Be brief.")
    assert chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_items_map_onto_chat_messages() -> None:
    req = request(
        input=[
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "now", "arguments": ""},
            {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "noon"}]},
            {"type": "function_call", "call_id": "c3", "name": "now", "arguments": "{}"},
        ]
    )  # fmt: skip
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert chat_messages(req) == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", **call},
            {"id": "c2", "type": "function", "function": {"name": "now", "arguments": ""}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        ]},
    ]  # fmt: skip


def test_the_chat_request_of_every_honoured_field() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = request(
        input="Hi",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        top_k=4,
        stream=True,
    )
    chat = chat_request(req)
    assert chat.model_dump(exclude_defaults=True, by_alias=True) == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather.", "parameters": WEATHER}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": False,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "out", "schema": schema, "strict": True}},
        "max_completion_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 3,
        "top_k": 4,
        "stream": True,
    }  # fmt: skip


def test_without_tools_auto_choice_and_parallel_flag_are_dropped() -> None:
    chat = chat_request(request(input="Hi", tools=[], tool_choice="auto", parallel_tool_calls=True))
    assert (chat.tools, chat.tool_choice, chat.parallel_tool_calls) == (None, None, None)
    assert chat_request(request(input="Hi", text={"format": {"type": "json_object"}})).model_dump(
        include={"response_format"}
    ) == {"response_format": {"type": "json_object", "json_schema": None}}
    assert chat_request(request(input="Hi", text={"format": {"type": "text"}})).response_format
    assert chat_request(request(input="Hi", tool_choice="required")).tool_choice == "required"


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"store": True}, "store", "store: true is not supported"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"background": True}, "background", "background: true is not supported"),
        ({"prompt": {"id": "p"}}, "prompt", "prompt templates are not supported"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning is not supported"),
        ({"include": ["reasoning.encrypted_content"]}, "include",
         "include `reasoning.encrypted_content` is not supported"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs is not supported"),
        ({"truncation": "auto"}, "truncation", 'truncation "auto" is not supported'),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "text.verbosity is not supported"),
        ({"tools": [TOOL, {"type": "web_search"}]}, "tools[1].type",
         "tool type `web_search` is not supported"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "a function tool needs a name"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice",
         "tool_choice type `web_search_preview` is not supported"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.name", "needs the function's name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
         "needs a schema"),
    ],
)  # fmt: skip
def test_fields_not_honoured_are_refused(fields: dict[str, Any], param: str, message: str) -> None:
    error = refusal(input="Hi", **fields)
    assert error.param == param and message in error.message


@pytest.mark.parametrize(
    ("items", "param", "message"),
    [
        ("", "input", "input must not be empty"),
        ([], "input", "input must not be empty"),
        ([{"type": "reasoning", "summary": []}], "input[0].type",
         "input item type `reasoning` is not supported"),
        ([{"content": "Hi"}], "input[0].role", "input[0].role is required"),
        ([{"role": "user"}], "input[0].content", "input[0].content is required"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
         "input[0].content[0].type", "content type `input_image` is not supported"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0].text",
         "is required"),
        ([{"type": "function_call_output", "call_id": "c9", "output": "x"}], "input[0].call_id",
         "no function_call before it has call_id `c9`"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}],
         "input[0].arguments", "must be a JSON object"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
         "input[0].arguments", "is not valid JSON"),
        ([{"type": "function_call", "call_id": "c", "arguments": "{}"}], "input[0].name",
         "is required"),
    ],
)  # fmt: skip
def test_bad_input_items_name_their_place(items: Any, param: str, message: str) -> None:
    error = refusal(input=items)
    assert error.param == param and message in error.message


def test_unknown_fields_and_bad_shapes_do_not_parse() -> None:
    for body, loc in [
        ({"input": "x", "frequency_penalty": 1}, ("frequency_penalty",)),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, ("metadata",)),
        ({"input": "x", "text": {"format": {"type": "json_schema", "bogus": 1}}},
         ("text", "format", "bogus")),
        ({"input": [{"role": "tool", "content": "x"}]}, ("input", 0, "role")),
    ]:  # fmt: skip
        with pytest.raises(ValidationError) as caught:
            ResponsesRequest.model_validate(body)
        assert caught.value.errors()[0]["loc"] == loc


def test_chat_params_become_responses_params() -> None:
    assert [
        responses_param(p)
        for p in (None, "messages", "messages[2].tool_calls", "tools[1].function.parameters",
                  "response_format", "max_completion_tokens", "max_tokens", "tool_choice")
    ] == [None, "input", "input", "tools[1].parameters", "text.format", "max_output_tokens",
          "max_output_tokens", "tool_choice"]  # fmt: skip


def test_the_job_is_the_chat_job_with_a_response_id(tok: Tokenizer) -> None:
    info = served_model("tiny", max_model_len=1024)
    req = request(input="Hi", instructions="Be brief.", tools=[TOOL], max_output_tokens=9)
    system, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}
    function = {k: v for k, v in TOOL.items() if k != "type"}
    job = prepare_response(req, tok, info)
    chat = ChatCompletionRequest.model_validate(
        {
            "model": "tiny",
            "messages": [system, user],
            "tools": [{"type": "function", "function": function}],
            "max_completion_tokens": 9,
        }
    )  # fmt: skip
    want = prepare_chat(chat, tok, info)
    assert job.response_id.startswith("resp_") and len(job.response_id) == 5 + 32
    assert [r.request_id for r in job.requests] == [job.response_id]
    assert job.requests[0].prompt_token_ids == want.requests[0].prompt_token_ids
    assert job.requests[0].sampling == want.requests[0].sampling
    assert job.requests[0].sampling.max_tokens == 9
    assert (job.kind, job.tools, job.stream, job.n) == ("chat", want.tools, False, 1)


def test_chat_errors_name_responses_fields(tok: Tokenizer) -> None:
    info = served_model("tiny", max_model_len=64)
    with pytest.raises(OpenAIError) as caught:
        prepare_response(request(input="Hi", max_output_tokens=1000), tok, info)
    error = caught.value
    assert (error.param, error.code) == ("input", "context_length_exceeded")
    n = len(tok.encode_chat([{"role": "user", "content": "Hi"}]))
    assert error.message == (
        f"This model's maximum context length is 64 tokens. However, you requested {n + 1000} "
        f"tokens ({n} in the input, 1000 in the completion). Please reduce the length of the "
        "input or completion."
    )
    with pytest.raises(OpenAIError) as caught:
        prepare_response(request(input="Hi " * 100), tok, info)
    assert caught.value.param == "input"
    tool = {**TOOL, "name": "now"}
    with pytest.raises(OpenAIError) as caught:  # two tools of one name: chat's check
        prepare_response(request(input="Hi", tools=[tool, tool]), tok, info)
    assert caught.value.param == "tools[1].name"
    with pytest.raises(OpenAIError) as caught:
        prepare_response(request(input="Hi", tool_choice="required"), tok, info)
    assert (caught.value.param, caught.value.message) == (
        "tool_choice",
        "tool_choice requires tools",
    )


def test_a_json_schema_format_constrains_the_output(tok: Tokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    job = prepare_response(request(input="Hi", text=fmt), tok, served_model("tiny", 256))
    assert job.requests[0].sampling.structured == StructuredSpec("json", json.dumps(schema))


def test_the_key_cap_names_max_output_tokens() -> None:
    tenant = Tenant(name="t", max_tokens=8)
    check_output_tokens(request(input="x", max_output_tokens=8), tenant)
    with pytest.raises(OpenAIError) as caught:
        check_output_tokens(request(input="x", max_output_tokens=9), tenant)
    assert (caught.value.param, caught.value.code) == ("max_output_tokens", "max_tokens_exceeded")
    assert (
        caught.value.message
        == "max_output_tokens is 9, more than this key's limit of 8 per request"
    )


def test_text_then_calls_make_items_and_events() -> None:
    items = OutputItems(counter())
    events = items.feed(ChoiceUpdate(0, text="Let me"))
    events += items.feed(ChoiceUpdate(0, text=" look."))
    events += items.feed(
        ChoiceUpdate(0, tool_calls=[ToolCallDelta(0, '{"city": ', "call_a", "get_weather")])
    )
    events += items.feed(ChoiceUpdate(0, tool_calls=[ToolCallDelta(0, '"Paris"}')]))
    events += items.feed(
        ChoiceUpdate(
            0, tool_calls=[ToolCallDelta(1, "{}", "call_b", "now")], finish_reason="tool_calls"
        )
    )
    events += items.finish()
    text = {"type": "output_text", "annotations": [], "logprobs": []}
    message = {"id": "msg_1", "type": "message", "role": "assistant"}
    call = {"id": "fc_2", "type": "function_call", "call_id": "call_a", "name": "get_weather"}
    call2 = {"id": "fc_3", "type": "function_call", "call_id": "call_b", "name": "now"}
    assert events == [
        {"type": "response.output_item.added", "output_index": 0,
         "item": {**message, "status": "in_progress", "content": []}},
        {"type": "response.content_part.added", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "part": {**text, "text": ""}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "delta": "Let me", "logprobs": []},
        {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "delta": " look.", "logprobs": []},
        {"type": "response.output_text.done", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "text": "Let me look.", "logprobs": []},
        {"type": "response.content_part.done", "item_id": "msg_1", "output_index": 0,
         "content_index": 0, "part": {**text, "text": "Let me look."}},
        {"type": "response.output_item.done", "output_index": 0,
         "item": {**message, "status": "completed", "content": [{**text, "text": "Let me look."}]}},
        {"type": "response.output_item.added", "output_index": 1,
         "item": {**call, "status": "in_progress", "arguments": ""}},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_2", "output_index": 1,
         "delta": '{"city": '},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_2", "output_index": 1,
         "delta": '"Paris"}'},
        {"type": "response.function_call_arguments.done", "item_id": "fc_2", "output_index": 1,
         "arguments": '{"city": "Paris"}'},
        {"type": "response.output_item.done", "output_index": 1,
         "item": {**call, "status": "completed", "arguments": '{"city": "Paris"}'}},
        {"type": "response.output_item.added", "output_index": 2,
         "item": {**call2, "status": "in_progress", "arguments": ""}},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_3", "output_index": 2,
         "delta": "{}"},
        {"type": "response.function_call_arguments.done", "item_id": "fc_3", "output_index": 2,
         "arguments": "{}"},
        {"type": "response.output_item.done", "output_index": 2,
         "item": {**call2, "status": "completed", "arguments": "{}"}},
    ]  # fmt: skip
    for i, event in enumerate(events):  # each one as the SDK types it
        EVENTS.validate_python({**event, "sequence_number": i})
    assert [item["id"] for item in items.json()] == ["msg_1", "fc_2", "fc_3"]
    assert items.finish_reason == "tool_calls"


def test_an_empty_output_is_an_empty_message_and_length_leaves_it_incomplete() -> None:
    items = OutputItems(counter())
    items.feed(ChoiceUpdate(0, finish_reason="length"))
    events = items.finish()
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert items.json() == [
        {"id": "msg_1", "type": "message", "status": "incomplete", "role": "assistant",
         "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
    ]  # fmt: skip
    assert final_status("length") == ("incomplete", {"reason": "max_output_tokens"})
    assert final_status("stop") == final_status("tool_calls") == ("completed", None)
    assert final_status("abort") == ("failed", None)


def test_the_response_object_echoes_the_request_and_parses_in_the_sdk(tok: Tokenizer) -> None:
    req = request(
        input="Hi",
        instructions="Be brief.",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.0,
        max_output_tokens=20,
        metadata={"k": "v"},
        user="u1",
        text={"format": {"type": "text"}},
    )
    job = prepare_response(req, tok, served_model("tiny", 1024))
    items = OutputItems(counter())
    items.feed(ChoiceUpdate(0, text='{"a": 1}', finish_reason="stop"))
    items.finish()
    usage = Usage(prompt_tokens=30, completion_tokens=6, cached_tokens=16)
    body = response_json(job, echo(req), "completed", items.json(), usage, completed_at=123)
    assert body == {
        "id": job.response_id,
        "object": "response",
        "created_at": job.created,
        "status": "completed",
        "completed_at": 123,
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": "Be brief.",
        "max_output_tokens": 20,
        "max_tool_calls": None,
        "model": "tiny",
        "output": items.json(),
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 0.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": {"type": "function", "name": "get_weather"},
        "tools": [{"type": "function", "name": "get_weather", "description": "Weather.",
                   "parameters": WEATHER, "strict": None}],
        "top_logprobs": 0,
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": {
            "input_tokens": 30,
            "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
            "output_tokens": 6,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 36,
        },
        "user": "u1",
        "metadata": {"k": "v"},
    }  # fmt: skip
    parsed = Response.model_validate(body)
    assert parsed.output_text == '{"a": 1}'
    assert usage_json(usage)["total_tokens"] == 36
    defaults = echo(request(input="Hi"))
    assert (defaults["tool_choice"], defaults["text"], defaults["tools"]) == (
        "auto",
        {"format": {"type": "text"}},
        [],
    )
    assert (defaults["temperature"], defaults["top_p"], defaults["metadata"]) == (1.0, 1.0, {})
