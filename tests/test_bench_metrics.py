"""Benchmark metrics from synthetic SSE timestamps: exact values, vLLM's definitions."""

from __future__ import annotations

import io
import json
import math

import pytest

from pdserve.bench.client import StreamParser, Target, request_body
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import RequestOutput, Slo, parse_slo, percentile_key, summarize
from pdserve.bench.report import Progress, result_table, sweep_row


def data(body: dict) -> str:
    return "data: " + json.dumps(body)


def feed(parser: StreamParser, events: list[tuple[float, str]]) -> RequestOutput:
    for now, line in events:
        if parser.feed(line, now):
            break
    return parser.output(RequestOutput(prompt_tokens=99))


def test_completion_stream_timings() -> None:
    out = feed(
        StreamParser(start=0.0, chat=False),
        [
            (0.0625, ": keep-alive"),
            (0.125, data({"choices": [{"index": 0, "text": ""}]})),  # TTFT: choices, no text
            (0.375, data({"choices": [{"index": 0, "text": "a"}]})),  # first content
            (0.5, ""),
            (0.5, data({"choices": [{"index": 0, "text": "b"}]})),
            (0.75, data({"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]})),
            (1.0, data({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4}})),
            (1.25, "data: [DONE]"),
            (2.0, data({"choices": [{"index": 0, "text": "after done"}]})),
        ],
    )
    assert out.success and out.error == ""
    assert out.ttft == 0.125
    assert out.ttft_content == 0.375
    assert out.itl == [0.25, 0.125, 0.25]
    assert out.latency == 0.75  # the last chunk carrying choices, not the usage chunk
    assert (out.output_tokens, out.prompt_tokens) == (4, 7)
    assert out.tpot == (0.75 - 0.125) / 3
    assert out.generated_text == "abc"


def test_chat_stream_role_chunk_and_missing_usage() -> None:
    out = feed(
        StreamParser(start=1.0, chat=True),
        [
            (1.5, data({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})),
            (2.0, data({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})),
            (3.0, data({"choices": [{"index": 0, "delta": {"content": " there"}}]})),
            (3.5, "data: [DONE]"),
        ],
    )
    assert (out.ttft, out.ttft_content, out.latency) == (0.5, 1.0, 2.0)
    assert out.itl == [0.5, 1.0]
    # no usage: one token per content chunk; the workload's prompt count stays
    assert (out.output_tokens, out.prompt_tokens, out.tpot) == (2, 99, 1.5)


def test_error_event_and_empty_stream_fail() -> None:
    out = feed(
        StreamParser(start=0.0, chat=False),
        [
            (0.25, data({"choices": [{"index": 0, "text": "a"}]})),
            (0.5, data({"error": {"message": "worker died", "type": "server_error"}})),
            (0.75, "data: [DONE]"),
        ],
    )
    assert (out.success, out.error) == (False, "worker died")
    out = feed(StreamParser(start=0.0, chat=False), [(0.5, "data: [DONE]")])
    assert (out.success, out.error) == (False, "the stream carried no chunk with choices")


def output(ttft: float, latency: float, tokens: int, prompt: int, itl: list[float]):
    return RequestOutput(
        success=True,
        ttft=ttft,
        latency=latency,
        output_tokens=tokens,
        prompt_tokens=prompt,
        itl=itl,
        ttft_content=ttft,
    )


def test_summary_exact_values() -> None:
    outputs = [
        output(0.125, 0.625, 5, 10, [0.25, 0.25]),  # TPOT 0.125
        output(0.25, 1.25, 5, 20, [0.5, 0.5]),  # TPOT 0.25 (the SLO exactly)
        output(0.5, 0.5, 1, 30, []),  # one token: no TPOT; counts as 0 for goodput
        RequestOutput(error="HTTP 503: overloaded"),
        output(1.0, 3.0, 5, 40, [1.0, 1.0]),  # TPOT 0.5: misses the SLO
    ]
    r = summarize(outputs, 4.0, parse_slo(["ttft:500", "tpot:250"]), (90, 99))
    assert (r["completed"], r["failed"], r["duration"]) == (4, 1, 4.0)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (100, 16)
    assert r["request_throughput"] == 1.0
    assert r["output_throughput"] == 4.0
    assert r["total_token_throughput"] == 29.0
    assert (r["good_requests"], r["request_goodput"], r["slo_attainment"]) == (3, 0.75, 0.6)
    assert r["error_summary"] == {"HTTP 503: overloaded": 1}
    # TTFT over completed requests: 125, 250, 500, 1000 ms
    assert r["mean_ttft_ms"] == 468.75
    assert r["median_ttft_ms"] == 375.0
    assert r["std_ttft_ms"] == pytest.approx(math.sqrt(112304.6875), rel=1e-15)
    assert r["p90_ttft_ms"] == pytest.approx(850.0, rel=1e-15)  # linear: 500 + 0.7 × 500
    assert r["p99_ttft_ms"] == pytest.approx(985.0, rel=1e-15)
    assert r["max_ttft_ms"] == 1000.0
    # TPOT only for outputs > 1 token: 125, 250, 500 ms
    assert r["mean_tpot_ms"] == pytest.approx(875.0 / 3, rel=1e-15)
    assert (r["median_tpot_ms"], r["max_tpot_ms"]) == (250.0, 500.0)
    assert r["p90_tpot_ms"] == pytest.approx(450.0, rel=1e-15)
    assert r["p99_tpot_ms"] == pytest.approx(495.0, rel=1e-15)
    # ITL pooled: 250, 250, 500, 500, 1000, 1000
    assert (r["mean_itl_ms"], r["median_itl_ms"], r["max_itl_ms"]) == (583.3333333333334, 500, 1000)
    # E2EL: 625, 1250, 500, 3000
    assert (r["mean_e2el_ms"], r["median_e2el_ms"]) == (1343.75, 937.5)


def test_summary_without_slo_or_successes() -> None:
    r = summarize([RequestOutput(error="boom")], 2.0, Slo(), (99.9,))
    assert (r["completed"], r["failed"], r["request_throughput"]) == (0, 1, 0.0)
    assert (r["request_goodput"], r["slo_attainment"], r["good_requests"]) == (None, None, None)
    assert (r["mean_ttft_ms"], r["p99.9_ttft_ms"], r["max_itl_ms"]) == (0.0, 0.0, 0.0)


def test_slo_e2el_and_parsing() -> None:
    slo = parse_slo(["e2el:1000"])
    assert slo == Slo(e2el_ms=1000.0)
    r = summarize([output(0.1, 1.0, 2, 1, [0.9]), output(0.1, 1.5, 2, 1, [1.4])], 1.0, slo)
    assert (r["good_requests"], r["slo_attainment"]) == (1, 0.5)
    for bad in (["ttft"], ["itl:5"], ["tpot:x"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="bad SLO"):
            parse_slo(bad)
    assert (percentile_key(99), percentile_key(99.9), percentile_key(50.0)) == (
        "p99",
        "p99.9",
        "p50",
    )


def test_request_bodies() -> None:
    req = BenchRequest("tell me", 12, 2, system="you are terse")
    target = Target("http://h:1/", "/v1/completions", "m", ignore_eos=True, temperature=0.0)
    assert request_body(target, req) == {
        "model": "m",
        "prompt": "you are terse tell me",
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert target.url == "http://h:1/v1/completions"
    chat = Target("http://h:1", "/v1/chat/completions", "m", "k", extra_body={"top_k": 3})
    body = request_body(chat, req, stream=False)
    assert body == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "you are terse"},
            {"role": "user", "content": "tell me"},
        ],
        "max_completion_tokens": 12,
        "top_k": 3,
    }
    assert chat.headers() == {"Authorization": "Bearer k"}
    conversation = BenchRequest("", 3, 0, messages=({"role": "user", "content": "x"},))
    assert request_body(chat, conversation)["messages"] == [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="chat/completions"):
        request_body(target, conversation)


def test_progress_line_and_tables() -> None:
    progress = Progress("r4: ", stream=io.StringIO(), width=10)
    progress.t0, progress.total = 100.0, 4
    progress.finished(output(0.125, 0.625, 5, 10, []))
    progress.finished(RequestOutput(error="x"))
    assert (
        progress.line(102.5)
        == "r4: [#####.....] 2/4 fail 1    2.5s | TTFT p50 125ms TPOT p50 125.0ms"
    )
    result = summarize([output(0.125, 0.625, 5, 10, [])], 2.0, parse_slo(["tpot:100"]))
    result.update(sweep_stage="rate", request_rate="inf")
    assert sweep_row(result).split() == [
        "rate",
        "inf",
        "1",
        "0",
        "0.50",
        "2.5",
        "0.00",
        "0.0%",
        "125.0",
        "125.0",
        "0.0",
    ]
    table = result_table(result, (90, 99))
    assert "SLO attainment:                          0.0%" in table
    assert "TPOT              125.00    125.00    125.00    125.00    125.00" in table
