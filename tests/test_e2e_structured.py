"""Structured outputs end to end: ``pdserve serve`` (1P1D and colocated), the openai client;
every output under a schema parses and validates, streamed equals non-streamed, disaggregated
equals colocated."""

from __future__ import annotations

import json
import os
import re
import signal

import jsonschema_rs
import openai
import pytest

from tests.e2e_util import ServedCluster
from tests.gateway_util import wait_until
from tests.test_e2e_resilience import pids_of, stream_on_a_decode_worker
from tests.test_structured import LIST_SCHEMA, SCHEMA


@pytest.fixture(scope="module")
def clusters(tiny_dir):
    disagg = ServedCluster(tiny_dir, "--num-kv-blocks=512")
    try:
        coloc = ServedCluster(tiny_dir, "--num-kv-blocks=512", "--mode=colocated")
    except BaseException:
        disagg.stop()
        raise
    yield {"disagg": disagg, "colocated": coloc}
    disagg.stop()
    coloc.stop()


def api(c: ServedCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0)


def chat(c: ServedCluster, stream: bool = False, **kw):
    body = {
        "model": c.model_name,
        "messages": [{"role": "user", "content": "Describe a thing as JSON."}],
        "max_tokens": 150,
        "temperature": 0,
        **kw,
    }
    if not stream:
        out = api(c).chat.completions.create(**body)
        return out.choices[0].message.content, out.choices[0].finish_reason
    parts, reason = [], None
    for chunk in api(c).chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(parts), reason


def schema_format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("schema", [SCHEMA, LIST_SCHEMA], ids=["object", "list"])
def test_json_schema_validates_streamed_and_across_modes(clusters, schema) -> None:
    results = {
        (mode, stream): chat(c, stream, response_format=schema_format(schema))
        for mode, c in clusters.items()
        for stream in (False, True)
    }
    assert len(set(results.values())) == 1, results
    text, reason = results["disagg", False]
    assert reason == "stop"
    jsonschema_rs.validate(schema, json.loads(text))


def test_sampled_outputs_validate(clusters) -> None:
    c = clusters["disagg"]
    out = api(c).chat.completions.create(
        model=c.model_name,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=150,
        temperature=1.0,
        seed=5,
        n=4,
        response_format=schema_format(SCHEMA),
    )
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema_rs.validate(SCHEMA, json.loads(choice.message.content))


def test_json_object_regex_choice_grammar_and_guided(clusters) -> None:
    c = clusters["disagg"]
    # greedy, the random tiny model never closes the object (it repeats a digit to the end);
    # this seed's sample closes it after 161 tokens
    json_object = {"type": "json_object"}
    text, reason = chat(c, response_format=json_object, max_tokens=300, temperature=1.0, seed=0)
    assert reason == "stop", text
    assert isinstance(json.loads(text), dict)
    cases = [
        ({"structured_outputs": {"regex": r"[a-z]{2,5}-[0-9]"}}, r"[a-z]{2,5}-[0-9]"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
        ({"structured_outputs": {"grammar": 'root ::= "A" [0-9] [0-9]'}}, r"A[0-9]{2}"),
        ({"guided_regex": r"[0-9]{3}"}, r"[0-9]{3}"),
        ({"guided_json": {"type": "boolean"}}, r"true|false"),
    ]
    for body, pattern in cases:
        text, reason = chat(c, extra_body=body, max_tokens=40)
        assert reason == "stop" and re.fullmatch(pattern, text), (body, text)
    out = api(c).completions.create(
        model=c.model_name,
        prompt="a",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert out.choices[0].text in {"left", "right"}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": {"type": "xml"}}, None, "response_format"),
        (
            {"response_format": schema_format({"type": "object", "properties": 3})},
            "response_format",
            "schema",
        ),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "at most one"),
        ({"guided_whitespace_pattern": " "}, None, "guided_whitespace_pattern"),
    ],
)
def test_bad_constraints_are_400_and_lose_nothing(clusters, body, param, words) -> None:
    c = clusters["disagg"]
    with pytest.raises(openai.BadRequestError) as info:
        chat(c, extra_body=body, max_tokens=5)
    error = info.value.body
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param
    # the refusal held nothing, and the cluster still serves: a request right after it gets
    # all its tokens
    wait_until(lambda: c.gateway_in_flight() == 0, what="the refused request gone")
    out = api(c).chat.completions.create(
        model=c.model_name,
        messages=[{"role": "user", "content": "Describe a thing as JSON."}],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("length", 3)


LONG_SCHEMA = {  # about 1,000 tokens: still going when its decode worker is killed
    "type": "array",
    "items": {"enum": ["alpha", "beta", "gamma"]},
    "minItems": 220,
    "maxItems": 220,
}


def test_kv_faults_under_recompute_still_validate(tiny_dir, clusters) -> None:
    faulty = ServedCluster(tiny_dir, "--num-kv-blocks=512", "--kv-fault=corrupt")
    try:
        for schema in (SCHEMA, LIST_SCHEMA):
            got = chat(faulty, response_format=schema_format(schema))
            assert got == chat(clusters["disagg"], response_format=schema_format(schema))
            assert got[1] == "stop"
            jsonschema_rs.validate(schema, json.loads(got[0]))
        assert "KV transfer" in faulty.output()  # the faults did happen
        assert set(faulty.wait_blocks_free().values()) == {0.0}
    finally:
        faulty.stop()


def test_decode_worker_killed_mid_structured_output_migrates(small_dir) -> None:
    c = ServedCluster(small_dir, "--prefill=1", "--decode=2", "--kv-cache-memory=256M")
    try:
        body = {
            "model": c.model_name,
            "prompt": "a long list",
            "max_tokens": 1800,
            "temperature": 0,
            "stream": True,
            "structured_outputs": {"json": LONG_SCHEMA},
        }
        events: list[str] = []
        t, busy = stream_on_a_decode_worker(c, body, events)
        [pid] = pids_of(busy[0], c.proc.pid)
        os.kill(pid, signal.SIGKILL)
        t.join(180)  # a hang bound only
        assert not t.is_alive(), "the stream hung"
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in chunk for chunk in chunks), chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
        jsonschema_rs.validate(LONG_SCHEMA, json.loads(text))
        resumed = re.search(r"resuming after (\d+) tokens", c.output())
        assert resumed and int(resumed.group(1)) > 0, "the stream never moved mid-way"
    finally:
        c.stop()
