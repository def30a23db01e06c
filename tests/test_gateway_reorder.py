"""The backends' contract: each choice's chunks in index order, every token once, one final chunk
(``gateway.token_streams.ChoiceOrder``), through the fake backend and the ZMQ client; and one SSE
event per token unless the reader falls behind the stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.jobs import Job
from pdserve.gateway.responses import stream_events
from pdserve.gateway.run import JobRun
from pdserve.gateway.token_streams import ChoiceOrder
from pdserve.gateway.zmq_backend import ZmqBackend
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from tests.gateway_util import (
    MODELS,
    FakeBackend,
    FakeCluster,
    Script,
    Serve,
    chunk,
    generate,
    served_model,
    wait_for,
)

TEXT = "one two three four five six seven"


def c(index: int, ids: list[int], final: bool = False) -> m.TokenChunk:
    return m.TokenChunk(
        request_id="r",
        choice=0,
        index=index,
        token_ids=ids,
        logprobs=None,
        finished=final,
        finish_reason="stop" if final else None,
        num_prompt_tokens=3,
        num_cached_tokens=0,
    )


def indices(chunks: list[m.TokenChunk]) -> list[int]:
    return [x.index for x in chunks]


# ---- ChoiceOrder ---------------------------------------------------------------------------


def test_in_order_chunks_pass_at_once() -> None:
    order = ChoiceOrder()
    first, second = c(0, [5]), c(1, [6, 7])
    assert order.push(first) == [first] and order.push(second) == [second]
    assert (order.token_ids, order.held, order.done) == ([5, 6, 7], {}, False)


def test_out_of_order_chunks_wait_for_the_gap() -> None:
    order = ChoiceOrder()
    assert order.push(c(3, [8])) == [] and order.push(c(1, [6, 7])) == []  # token 0 is late
    assert indices(order.push(c(0, [5]))) == [0, 1, 3]
    assert order.push(c(5, [10], final=True)) == []
    assert indices(order.push(c(4, [9]))) == [4, 5]
    assert (order.token_ids, order.held, order.done) == ([5, 6, 7, 8, 9, 10], {}, True)


def test_repeats_and_what_follows_the_end_are_dropped() -> None:
    order = ChoiceOrder()
    order.push(c(0, [5]))
    assert order.push(c(0, [5])) == []  # passed on already
    held = c(2, [7])
    assert order.push(held) == [] and order.push(c(2, [99])) == []  # the first held stays
    assert order.push(c(1, [6])) == [c(1, [6]), held]
    assert order.push(c(1, [6, 7, 8])) == []  # starts before the next index: dropped whole
    assert indices(order.push(c(3, [8], final=True))) == [3]
    assert order.push(c(4, [9])) == [] and order.push(c(3, [8], final=True)) == []
    assert order.token_ids == [5, 6, 7, 8]


def test_a_longer_chunk_overlapping_held_ones_makes_them_repeats() -> None:
    order = ChoiceOrder()
    order.push(c(2, [7])), order.push(c(5, [10]))
    assert indices(order.push(c(0, [5, 6, 7, 8]))) == [0]  # covers 2: held 2 is a repeat now
    assert order.held == {5: c(5, [10])}
    assert indices(order.push(c(4, [9]))) == [4, 5]


def test_empty_chunks() -> None:
    order = ChoiceOrder()
    assert order.push(c(0, [])) == []  # nothing to pass on
    order.push(c(0, [5]))
    end = c(2, [], final=True)  # the end, after a gap: held like any chunk
    assert order.push(end) == [] and order.push(c(1, [6])) == [c(1, [6]), end]
    assert order.done


def test_restart_drops_what_is_held_and_keeps_what_passed() -> None:
    order = ChoiceOrder()
    order.push(c(0, [5])), order.push(c(2, [7]))
    order.restart()  # the choice moves: its new worker sends everything after token 0 again
    assert (order.token_ids, order.held) == ([5], {})
    assert order.push(c(0, [5])) == [] and indices(order.push(c(1, [16, 17]))) == [1]


# ---- through a JobRun over the fake backend ------------------------------------------------


def run(tok: Tokenizer, script: Script, *, slow: bool = False, **kw: Any) -> tuple[list, Any]:
    """The SSE events (parsed) of one completion; ``slow``: the reader stalls after the first."""
    backend = FakeBackend(MODELS, script)
    request = generate("cmpl-1", [1, 2, 3], SamplingParams(max_tokens=64))
    job = Job(kind="completion", response_id="cmpl-1", model="tiny", requests=[request],
              stream=True, include_usage=True)  # fmt: skip

    async def main() -> list[str]:
        job_run = JobRun(backend, tok, job, **kw)
        await job_run.start()
        events = []
        async for event in stream_events(job_run):
            events.append(event)
            if slow and len(events) == 1:  # the write waits: the rest of the stream comes
                for _ in range(100):  # loop turns, not seconds: the same on a loaded machine
                    await asyncio.sleep(0)
        return events

    events = asyncio.run(main())
    return [e[6:-2] if e == "data: [DONE]\n\n" else json.loads(e[6:-2]) for e in events], backend


def texts(events: list) -> list[str]:
    return [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices")]


@pytest.fixture
def ids(tok: Tokenizer) -> list[int]:
    out = tok.encode(TEXT, add_special_tokens=False)
    assert len(out) == 7
    return out


@pytest.mark.parametrize("how", [{"prefill_last": True}, {"repeat": True}, {"decode_batch": 3}])
def test_every_token_once_in_order(tok: Tokenizer, ids: list[int], how: dict) -> None:
    events, backend = run(tok, Script([ids], finish="length", **how))
    pieces = texts(events)
    assert "".join(pieces) == TEXT
    assert len(pieces) == (3 if how.get("decode_batch") else 7)  # an event per chunk
    assert events[-2]["usage"]["completion_tokens"] == 7
    assert backend.aborted == []


def test_a_gap_never_filled_fails_the_choice_cleanly(tok: Tokenizer, ids: list[int]) -> None:
    events, backend = run(tok, Script([ids], finish="length", drop=3))
    assert "".join(texts(events)) == tok.decode(ids[:3])  # the held tokens are never shown
    assert events[-2]["error"]["message"] == (
        "request cmpl-1: token stream ended before every choice"
    )
    assert backend.aborted == ["cmpl-1"]


def test_a_gap_on_a_silent_stream_ends_at_the_idle_bound(tok: Tokenizer, ids: list[int]) -> None:
    script = Script([ids], finish="length", drop=2, hang_after=5)
    events, backend = run(tok, script, idle_s=0.2)
    assert "".join(texts(events)) == tok.decode(ids[:2])
    assert events[-2]["error"]["code"] == "timeout"
    assert backend.aborted == ["cmpl-1"]


def test_a_reader_that_falls_behind_gets_the_rest_merged(tok: Tokenizer, ids: list[int]) -> None:
    events, _ = run(tok, Script([ids], finish="length"), slow=True)
    assert texts(events) == [tok.decode(ids[:1]), TEXT[len(tok.decode(ids[:1])) :]]
    assert events[1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 7


def test_a_stream_read_promptly_has_an_event_per_token(serve: Serve, ids: list[int]) -> None:
    url = serve(GatewayConfig(), Script([ids], finish="length", interval_s=0.002)).url
    options = {"include_usage": True, "continuous_usage_stats": True}  # tokens so far, each
    body = {"model": "tiny", "prompt": "Hi", "stream": True, "stream_options": options}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]
    content = [e for e in events if e["choices"]]
    assert "".join(e["choices"][0]["text"] for e in content) == TEXT
    assert [e["usage"]["completion_tokens"] for e in content] == [1, 2, 3, 4, 5, 6, 7]


# ---- through the ZMQ client: a migrated choice --------------------------------------------


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    fake = FakeCluster(lambda g: [])
    fake.state = m.ClusterState(models=[served_model("tiny", 256, root="/m")], workers=[])
    yield fake
    fake.close()


def test_a_migrated_choice_resumes_without_gap_or_repeat(
    cluster: FakeCluster, ids: list[int]
) -> None:
    def respond(g: m.Generate) -> list[tuple[str, Any]]:
        if g.resume_choice is None:  # token 0, tokens 1-2, then the decode worker dies
            return [
                ("prefill", chunk(g, 0, 0, ids[:1])),
                ("decode", chunk(g, 0, 1, ids[1:3])),
                ("decode", chunk(g, 0, 4, [999])),  # overtook 3, which never comes: held
                ("sleep", 0.1),
                (
                    "coordinator",
                    m.RequestError(
                        request_id=g.request_id,
                        status=503,
                        message="d0 died",
                        choice=0,
                        retryable=True,
                    ),
                ),
            ]
        return [  # the new worker repeats from token 1, then samples its own 3, 4, ...
            ("decode", chunk(g, 0, 1, ids[1:3])),
            ("decode", chunk(g, 0, 3, ids[3:4])),
            ("decode", chunk(g, 0, 4, ids[4:5])),
            ("decode", chunk(g, 0, 5, ids[5:], finish_reason="length")),
        ]

    cluster.respond = respond

    async def main() -> list[m.TokenChunk]:
        backend = ZmqBackend(cluster.address, hello_interval_s=0.02, state_timeout_s=60)
        await backend.start()
        try:
            assert await asyncio.to_thread(wait_for, backend.health)
            stream = await backend.submit(generate("r", [1, 2], SamplingParams(max_tokens=9)))
            return [x async for x in stream]
        finally:
            await backend.close()

    got = asyncio.run(main())
    assert [(x.index, x.token_ids) for x in got] == [
        (0, ids[:1]), (1, ids[1:3]), (3, ids[3:4]), (4, ids[4:5]), (5, ids[5:]),
    ]  # fmt: skip
    # the dead worker's token 4, held when it died, is gone
    assert got[-1].finished and not any(x.finished for x in got[:-1])
    _, resumed = cluster.generates
    assert (resumed.resume_choice, resumed.resume_token_ids) == (0, ids[:3])
