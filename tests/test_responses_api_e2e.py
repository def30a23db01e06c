"""``/v1/responses`` end to end: ``pdserve serve`` 1P1D on the random tiny model (its template
renders tools in the Qwen/Hermes style), the openai SDK as the client. Greedy text is the
chat completion's; a json_schema format and a named tool call validate whatever the weights
(constrained decoding); a call's output fed back gets a message; a stream's events come in
order and add up to its final response; bad inputs get OpenAI error bodies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import openai
import pytest

from tests.e2e_util import ServedCluster

# bounded: a random model cannot run a constrained output past max_output_tokens
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Köln"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
ASK = "What is the weather in Paris this week?"


@pytest.fixture(scope="module")
def cluster(tiny_dir) -> Iterator[ServedCluster]:
    c = ServedCluster(tiny_dir, "--num-kv-blocks=512")
    yield c
    c.stop()


def client(c: ServedCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)


def create(c: ServedCluster, **kw: Any) -> Any:
    body = {"model": c.model_name, "input": ASK, "temperature": 0, "max_output_tokens": 16, **kw}
    return client(c).responses.create(**body)


def test_greedy_text_is_the_chat_completions(cluster: ServedCluster) -> None:
    out = create(cluster, instructions="Be brief.", max_output_tokens=12)
    chat = client(cluster).chat.completions.create(
        model=cluster.model_name,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        max_tokens=12,
        temperature=0,
    )
    choice = chat.choices[0]
    assert out.output_text == choice.message.content
    assert out.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert out.usage is not None and chat.usage is not None
    assert (out.usage.input_tokens, out.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert out.id.startswith("resp_") and out.instructions == "Be brief."


def test_a_json_schema_format_validates(cluster: ServedCluster) -> None:
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    out = create(cluster, text={"format": fmt}, max_output_tokens=60)
    assert out.status == "completed"
    jsonschema_rs.validate(WEATHER, json.loads(out.output_text))
    assert out.text is not None and out.text.format is not None
    assert out.text.format.type == "json_schema"


def test_a_function_tool_round_trip(cluster: ServedCluster) -> None:
    named = {"type": "function", "name": "get_weather"}
    first = create(cluster, tools=[TOOL], tool_choice=named, max_output_tokens=60)
    assert first.status == "completed"
    [call] = first.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    jsonschema_rs.validate(WEATHER, json.loads(call.arguments))
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    # the SDK's output items fed back as they are, then the tool's result
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    second = create(cluster, input=items, tools=[TOOL], tool_choice="none", max_output_tokens=8)
    [message] = second.output
    assert message.type == "message" and second.output_text == message.content[0].text
    assert second.status in ("completed", "incomplete")
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens


def test_a_stream_in_order_adds_up_to_its_response(cluster: ServedCluster) -> None:
    body = {"model": cluster.model_name, "input": ASK, "temperature": 0, "max_output_tokens": 16}
    with client(cluster).responses.stream(**body) as stream:
        events = list(stream)
    # the terminal event's (the SDK's get_final_response wants response.completed: a random
    # model's greedy text may well run to max_output_tokens)
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if final.status == "completed" else "response.incomplete",
    ]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == deltas == create(cluster).output_text


def test_a_streamed_call_adds_up_to_its_arguments(cluster: ServedCluster) -> None:
    named = {"type": "function", "name": "get_weather"}
    body = {"model": cluster.model_name, "input": ASK, "temperature": 0, "max_output_tokens": 60,
            "tools": [TOOL], "tool_choice": named}  # fmt: skip
    with client(cluster).responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [call] = final.output
    assert call.type == "function_call" and "".join(deltas) == call.arguments
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments
    jsonschema_rs.validate(WEATHER, json.loads(call.arguments))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_0"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": []}, "input"),
        ({"extra_body": {"logit_bias": {"1": 2}}}, "logit_bias"),
    ],
)
def test_bad_inputs_get_openai_errors(
    cluster: ServedCluster, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        create(cluster, **fields)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert body["type"] == "invalid_request_error" and body["message"]
