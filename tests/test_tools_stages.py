"""gateway.tools.stages and responses.ToolOutput: model text -> content + tool calls, whole or
streamed."""

from __future__ import annotations

import itertools
import json

import pytest

from pdserve.gateway.choices import ChoiceUpdate
from pdserve.gateway.tools.calls import ToolCallDelta, accumulate, call_from_json, delta_json
from pdserve.gateway.tools.output import ToolOutput
from pdserve.gateway.tools.request import ToolPlan
from pdserve.gateway.tools.stages import make_stage

HERMES = ToolPlan("auto", parser="hermes")
LLAMA3 = ToolPlan("auto", parser="llama3_json")
REQUIRED = ToolPlan("required")
NAMED = ToolPlan("named", name="get_weather")
STEPS = (None, 1, 2, 3, 5, 11)  # None: the whole text in one piece


def run(plan: ToolPlan, text: str, step: int | None = None) -> tuple[str, list[tuple]]:
    """(content, [(id, name, arguments)]) of ``text`` fed ``step`` characters at a time."""
    ids = itertools.count()
    stage = make_stage(plan, lambda: f"call-{next(ids)}")
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    content, calls = "", []
    for piece in [*pieces, None]:
        more, deltas = stage.finish() if piece is None else stage.feed(piece)
        content += more
        accumulate(calls, deltas)
    assert stage.calls == len(calls)
    return content, [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def parsed(plan: ToolPlan, text: str) -> tuple[str, list[tuple]]:
    """``run`` at every step size; each must give the same result."""
    results = [run(plan, text, step) for step in STEPS]
    assert all(r == results[0] for r in results), results
    return results[0]


def test_hermes_content_then_calls() -> None:
    text = (
        "Let me check.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Köln", "days": [1, 2]}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"arguments": {}, "name": "now"}\n</tool_call>\n'
    )
    assert parsed(HERMES, text) == (
        "Let me check.",
        [
            ("call-0", "get_weather", '{"city": "Köln", "days": [1, 2]}'),
            ("call-1", "now", "{}"),
        ],
    )


def test_hermes_block_with_a_list_of_calls() -> None:
    calls = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": 1}}]'
    text = f"<tool_call>{calls}</tool_call>"
    assert parsed(HERMES, text) == ("", [("call-0", "f", "{}"), ("call-1", "g", '{"x": 1}')])
    for bad in ("[]", '[{"name": "f", "arguments": {}}, 3]'):
        assert parsed(HERMES, f"<tool_call>{bad}</tool_call>") == (
            f"<tool_call>{bad}</tool_call>",
            [],
        )


def test_hermes_plain_text_is_unchanged() -> None:
    for text in ("Hello <tool but not quite\n\n", "a < b <tool_cal", "  spaced  \n", ""):
        assert parsed(HERMES, text) == (text, [])


@pytest.mark.parametrize(
    "block",
    [
        '{"name": "f", "arguments": {"a": }',  # not JSON
        '{"arguments": {"a": 1}}',  # no name
        '{"name": "f", "arguments": [1]}',  # arguments not an object
        '{"name": "f", "arguments": "not json"}',
        '["f", {}]',
    ],
)
def test_hermes_malformed_block_falls_back_to_content(block: str) -> None:
    text = f"Hi <tool_call>{block}</tool_call> bye"
    assert parsed(HERMES, text) == (text, [])


def test_hermes_unclosed_block_and_string_arguments() -> None:
    # an unclosed block is parsed when it holds a whole call (vLLM does so too)
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n'
    assert parsed(HERMES, text) == ("", [("call-0", "f", '{"x": 1}')])
    cut = '<tool_call>\n{"name": "f", "arguments": {"x": '  # cut short (finish "length")
    assert parsed(HERMES, cut) == (cut, [])


def test_hermes_text_after_a_call_and_one_call_only() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nDone.\n'
    assert parsed(HERMES, text) == ("Done.", [("call-0", "f", "{}")])
    two = text.replace("Done.", '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    single = ToolPlan("auto", parser="hermes", parallel=False)
    assert parsed(single, two) == ("", [("call-0", "f", "{}")])


def test_llama3_json_calls() -> None:
    text = ' {"name": "f", "parameters": {"q": "a;b}{"}};\n{"name": "g", "arguments": {"n": 1}}'
    assert parsed(LLAMA3, text) == (
        "",
        [("call-0", "f", '{"q": "a;b}{"}'), ("call-1", "g", '{"n": 1}')],
    )
    tagged = '<|python_tag|>{"name": "f", "parameters": {}}'
    assert parsed(LLAMA3, tagged) == ("", [("call-0", "f", "{}")])


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        ' Hello {"name": "f", "parameters": {}}',  # JSON later in the text: content (vLLM)
        '{"name": "f", "parameters": {"a": 1',  # cut short
        '{"name": "f", "parameters": {"a": nope}}',  # malformed
        '{"city": "Paris"}',  # JSON, but no call
        "<|python_tag|>",
        "   ",
    ],
)
def test_llama3_json_anything_else_is_content(text: str) -> None:
    assert parsed(LLAMA3, text) == (text, [])


def test_llama3_json_text_after_calls_is_content() -> None:
    text = '{"name": "f", "parameters": {"a": 1}}; but then prose'
    assert parsed(LLAMA3, text) == ("but then prose", [("call-0", "f", '{"a": 1}')])


def test_required_array() -> None:
    text = '[{"name": "f", "parameters": {"a": [1, {"b": "]"}]}}, {"name": "g", "parameters": {}}]'
    assert parsed(REQUIRED, text) == (
        "",
        [("call-0", "f", '{"a": [1, {"b": "]"}]}'), ("call-1", "g", "{}")],
    )
    cut = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "param'
    # a call cut short (finish "length") is content: nothing is dropped without a word
    assert parsed(REQUIRED, cut) == ('{"name": "g", "param', [("call-0", "f", '{"a": 1}')])
    assert parsed(REQUIRED, "not an array") == ("not an array", [])
    assert parsed(REQUIRED, "[]") == ("[]", [])


def test_named_streams_its_arguments() -> None:
    assert parsed(NAMED, '{"city": "Paris"}') == (
        "",
        [("call-0", "get_weather", '{"city": "Paris"}')],
    )
    assert parsed(NAMED, "") == ("", [("call-0", "get_weather", "")])
    stage = make_stage(NAMED, lambda: "call-x")
    first, then = stage.feed('{"ci'), stage.feed('ty": 1}')
    assert first == ("", [ToolCallDelta(0, '{"ci', "call-x", "get_weather")])
    assert then == ("", [ToolCallDelta(0, 'ty": 1}')])
    assert stage.finish() == ("", [])


def test_call_from_json() -> None:
    assert call_from_json({"name": "f", "arguments": {"é": 1}}) == ("f", '{"é": 1}')
    assert call_from_json({"name": "f", "parameters": {"x": None}}) == ("f", '{"x": null}')
    assert call_from_json({"name": "f"}) == ("f", "{}")
    assert call_from_json({"name": "", "arguments": {}}) is None
    assert call_from_json({"name": 3, "arguments": {}}) is None
    assert call_from_json([]) is None


def test_delta_json_and_accumulate() -> None:
    deltas = [
        ToolCallDelta(0, "", "id0", "f"),
        ToolCallDelta(0, '{"a"'),
        ToolCallDelta(1, "", "id1", "g"),
    ]
    assert delta_json(deltas) == [
        {
            "index": 0,
            "id": "id0",
            "type": "function",
            "function": {"name": "f", "arguments": '{"a"'},
        },
        {"index": 1, "id": "id1", "type": "function", "function": {"name": "g", "arguments": ""}},
    ]
    assert delta_json([ToolCallDelta(0, ": 1}")]) == [
        {"index": 0, "function": {"arguments": ": 1}"}}
    ]
    calls: list[dict] = []
    accumulate(calls, deltas)
    accumulate(calls, [ToolCallDelta(0, ": 1}")])
    assert calls == [
        {"id": "id0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "id1", "type": "function", "function": {"name": "g", "arguments": ""}},
    ]


def test_output_sets_finish_reason_per_choice() -> None:
    out = ToolOutput(HERMES, 2, new_id=lambda: "id")
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    a = out.apply(ChoiceUpdate(0, text=call[:20], num_tokens=3, first=True))
    assert (a.text, a.tool_calls, a.finish_reason, a.num_tokens) == ("", [], None, 3)
    b = out.apply(ChoiceUpdate(0, text=call[20:], finish_reason="stop"))
    assert (b.text, b.finish_reason) == ("", "tool_calls")
    assert b.tool_calls == [ToolCallDelta(0, '{"a": 1}', "id", "f")]
    other = out.apply(ChoiceUpdate(1, text="plain", finish_reason="stop"))
    assert (other.text, other.tool_calls, other.finish_reason) == ("plain", [], "stop")
    cut = ToolOutput(NAMED, 1, new_id=lambda: "id").apply(
        ChoiceUpdate(0, text='{"a', finish_reason="length")
    )
    assert (cut.finish_reason, json.dumps(delta_json(cut.tool_calls))) == (
        "length",
        json.dumps([{"index": 0, "id": "id", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"a'}}]),
    )  # fmt: skip
