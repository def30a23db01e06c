"""``pdserve bench --dataset multi-turn``: conversations, history growth, the per-turn figures,
a run against an in-process fake server, and one against a real ``pdserve serve`` cluster."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from pdserve.bench import multi_turn
from pdserve.bench.client import StreamParser, Target
from pdserve.bench.metrics import RequestOutput, per_turn, summarize
from pdserve.bench.multi_turn import (
    MultiTurnSpec,
    build_conversations,
    run_conversations,
    turn_messages,
    turn_request,
)
from pdserve.bench.prompts import WordPrompts
from pdserve.bench.report import result_table
from pdserve.bench.runner import RunSpec
from pdserve.launch.cli import main
from tests.e2e_util import ServedCluster

CHAT = Target("http://fake", "/v1/chat/completions", "m")


def convs(spec: MultiTurnSpec, seed: int = 0):
    return build_conversations(WordPrompts(1.0), spec, np.random.default_rng(seed))


def test_conversations_share_one_system_prompt_and_follow_the_seed() -> None:
    spec = MultiTurnSpec(conversations=5, turns=3, system_len=12, user_len=4, output_len=7)
    cs = convs(spec)
    assert len(cs) == 5 and len({c.system for c in cs}) == 1
    assert len(cs[0].system.split()) == 12 and cs[0].system_len == 12
    assert {len(u.split()) for c in cs for u in c.users} == {4}
    assert {c.user_lens for c in cs} == {(4, 4, 4)} and {c.max_tokens for c in cs} == {(7, 7, 7)}
    assert len({u for c in cs for u in c.users}) == 15  # every user message its own
    assert convs(spec) == cs and convs(spec, seed=1) != cs
    ranged = convs(MultiTurnSpec(conversations=200, turns=2, user_len=10, range_ratio=0.5))
    user_lens = [n for c in ranged for n in c.user_lens]
    assert (min(user_lens), max(user_lens)) == (5, 15)
    assert [len(u.split()) for u in ranged[0].users] == list(ranged[0].user_lens)
    assert {c.system for c in convs(MultiTurnSpec(system_len=0, conversations=2))} == {""}


@pytest.mark.parametrize(
    "bad",
    [{"turns": 0}, {"conversations": 0}, {"user_len": 0}, {"system_len": -1}, {"think_time": -1}],
)
def test_spec_rejects_bad_knobs(bad) -> None:
    with pytest.raises(ValueError, match="multi-turn"):
        MultiTurnSpec(**bad)


def test_each_turn_resends_the_history_with_the_actual_answers() -> None:
    (conv,) = convs(MultiTurnSpec(conversations=1, turns=3, system_len=5, user_len=2))
    u1, u2, u3 = conv.users
    system = {"role": "system", "content": conv.system}
    assert turn_messages(conv, []) == [system, {"role": "user", "content": u1}]
    assert turn_messages(conv, ["A1", "A2"]) == [
        system,
        {"role": "user", "content": u1},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": u2},
        {"role": "assistant", "content": "A2"},
        {"role": "user", "content": u3},
    ]
    with pytest.raises(ValueError, match="no turn 4"):
        turn_messages(conv, ["A1", "A2", "A3"])
    answers = [
        RequestOutput(success=True, generated_text="x y", output_tokens=9),
        RequestOutput(success=True, generated_text="z", output_tokens=3),
    ]
    req = turn_request(conv, answers)
    assert (req.turn, req.max_tokens, req.kind) == (3, 64, "multi-turn")
    assert req.prompt_len == 5 + 2 + 2 + 2 + 9 + 3
    assert [m["content"] for m in req.messages if m["role"] == "assistant"] == ["x y", "z"]
    no_system = convs(MultiTurnSpec(conversations=1, turns=2, system_len=0))[0]
    assert [m["role"] for m in turn_messages(no_system, ["a"])] == ["user", "assistant", "user"]


def test_cached_tokens_come_from_the_usage_when_reported() -> None:
    def parsed(usage: dict) -> RequestOutput:
        parser = StreamParser(0.0, chat=True)
        parser.feed('data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}', 0.5)
        parser.feed("data: " + json.dumps({"choices": [], "usage": usage}), 0.75)
        return parser.output(RequestOutput())

    usage = {"prompt_tokens": 40, "completion_tokens": 1}
    out = parsed({**usage, "prompt_tokens_details": {"cached_tokens": 32}})
    assert (out.prompt_tokens, out.cached_tokens) == (40, 32)
    assert parsed(usage).cached_tokens is None
    assert parsed({**usage, "prompt_tokens_details": None}).cached_tokens is None  # vLLM


def out(turn: int, ttft: float, latency: float = 1.0, cached: int | None = None, ok=True):
    return RequestOutput(
        success=ok,
        turn=turn,
        ttft=ttft,
        latency=latency,
        output_tokens=5,
        prompt_tokens=10 * turn,
        cached_tokens=cached,
        error="" if ok else "boom",
    )


def test_per_turn_figures_are_exact() -> None:
    outputs = [
        out(1, 0.25),
        out(1, 0.75, ok=False),
        out(2, 0.125, cached=16),
        out(2, 0.375, latency=0.875, cached=0),
        out(3, 0.0625, cached=32),
        out(4, 0.1875, cached=48),
        out(4, 0.5, cached=None),
    ]
    pt = per_turn(outputs, turns=5, percentiles=(50,))
    assert list(pt) == ["1", "2", "3", "4", "5", "3+"]
    assert [(pt[k]["requests"], pt[k]["completed"]) for k in pt] == [
        (2, 1),
        (2, 2),
        (1, 1),
        (2, 2),
        (0, 0),
        (3, 3),
    ]
    assert [pt[k]["prompt_tokens"] for k in pt] == [10, 40, 30, 80, 0, 110]
    assert [pt[k]["cached_tokens"] for k in pt] == [None, 16, 32, 48, None, 80]
    assert pt["1"]["median_ttft_ms"] == 250.0 and pt["1"]["max_ttft_ms"] == 250.0
    assert pt["2"]["mean_ttft_ms"] == 250.0 and pt["2"]["p50_ttft_ms"] == 250.0
    # TPOT = (latency − ttft) / 4: (1 − 0.125) / 4 and (0.875 − 0.375) / 4
    assert (pt["2"]["mean_tpot_ms"], pt["2"]["max_tpot_ms"]) == (171.875, 218.75)
    assert pt["3+"]["median_ttft_ms"] == 187.5 and pt["3+"]["max_e2el_ms"] == 1000.0
    assert pt["5"]["median_ttft_ms"] == 0.0
    assert list(per_turn(outputs, turns=2)) == ["1", "2"]
    assert summarize(outputs, 1.0)["total_cached_tokens"] == 96
    assert summarize([out(1, 0.5)], 1.0)["total_cached_tokens"] is None

    result = {**summarize(outputs, 2.0, percentiles=(99,)), "per_turn": per_turn(outputs, 3)}
    table = result_table(result, (99,)).splitlines()
    i = next(n for n, line in enumerate(table) if "By turn" in line)
    head = "turn done fail prompt cached TTFT p50 TTFT p99 TPOT p50 TPOT p99"
    assert table[i + 1].split() == head.split()
    assert table[i + 2].split() == ["1", "1", "1", "10", "-", "250.0", "250.0", "187.5", "187.5"]
    assert table[i + 5].split()[:5] == ["3+", "3", "0", "110", "80"]


def fake_server(conversations, fail: tuple[int, int], clock=time.perf_counter):
    """An async handler answering ``ans-C-T`` (conversation C, turn T) and checking every
    request carries the answers given before; conversation and turn ``fail`` get a 500.
    ``log["gaps"]``: ``clock`` time from an answer to its conversation's next turn."""
    index = {c.users[0]: i for i, c in enumerate(conversations)}
    log: dict = {"active": set(), "max_active": 0, "bodies": [], "gaps": [], "answered": {}}

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        log["bodies"].append(body)
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        assistants = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        c, turn = index[users[0]], len(users)
        assert users == list(conversations[c].users[:turn])
        assert assistants == [f"ans-{c}-{t}" for t in range(1, turn)]
        if turn > 1:
            log["gaps"].append(clock() - log["answered"][c])
        log["active"].add(c)
        log["max_active"] = max(log["max_active"], len(log["active"]))
        await asyncio.sleep(0.01)
        if (c, turn) == fail or turn == len(conversations[c].users):
            log["active"].discard(c)
        if (c, turn) == fail:
            return httpx.Response(500, json={"error": {"message": "injected"}})
        words = sum(len(m["content"].split()) for m in body["messages"])
        usage = {
            "prompt_tokens": words,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 10 * (turn - 1)},
        }
        chunks = [{"choices": [{"index": 0, "delta": {"content": f"ans-{c}-{turn}"}}]}]
        chunks.append({"choices": [], "usage": usage})
        log["answered"][c] = clock()
        text = "".join(f"data: {json.dumps(x)}\n\n" for x in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return handler, log


class FakeClock:
    """The run's clock, moved only by the run's own sleeps (think time), never by the
    machine's load: ``time`` and ``asyncio`` for the multi_turn module."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)  # let the other conversations run

    def __getattr__(self, name: str) -> object:  # the rest of asyncio, as it is
        return getattr(asyncio, name)


def test_conversations_run_turn_by_turn_within_the_concurrency(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = MultiTurnSpec(conversations=5, turns=3, system_len=6, user_len=3, output_len=2)
    conversations = convs(spec)
    clock = FakeClock()
    monkeypatch.setattr(multi_turn, "time", clock)
    monkeypatch.setattr(multi_turn, "asyncio", clock)
    handler, log = fake_server(conversations, fail=(4, 2), clock=clock.perf_counter)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            run = RunSpec(max_concurrency=2)
            return await run_conversations(client, CHAT, conversations, run, think_time=0.05)

    outputs, duration = asyncio.run(go())
    assert log["max_active"] == 2  # conversations in flight, think time included
    # every next turn came after the think time: 9 of them (4 conversations x 2, 1 failed)
    assert min(log["gaps"]) >= 0.05 - 1e-9 and len(log["gaps"]) == 4 * 2 + 1
    assert len(outputs) == 4 * 3 + 2 and [o.error for o in outputs if not o.success] == [
        "HTTP 500: injected"
    ]
    assert [o.start_time for o in outputs] == sorted(o.start_time for o in outputs)
    assert {b["max_completion_tokens"] for b in log["bodies"]} == {2}
    pt = per_turn(outputs, 3)
    assert [(pt[k]["requests"], pt[k]["completed"]) for k in pt] == [
        (5, 5),
        (5, 4),
        (4, 4),
        (4, 4),
    ]
    # words: system 6 + users 3 each + answers 1 each: 9, 13, 17 per conversation
    assert [pt[k]["prompt_tokens"] for k in pt] == [45, 52, 68, 68]
    assert [pt[k]["cached_tokens"] for k in pt] == [0, 40, 80, 80]
    # the run's only waits are the 9 think times (a start time of 0 waits 0)
    assert sorted(set(clock.sleeps)) == [0.0, 0.05] and clock.sleeps.count(0.05) == 9
    assert duration == pytest.approx(9 * 0.05)

    with pytest.raises(ValueError, match="chat/completions"):
        asyncio.run(run_conversations(None, Target("http://x"), conversations, RunSpec()))


def test_no_turn_starts_after_the_duration(monkeypatch: pytest.MonkeyPatch) -> None:
    conversations = convs(MultiTurnSpec(conversations=2, turns=3, system_len=4, user_len=2))
    handler, _ = fake_server(conversations, fail=(-1, -1))
    now = [0.0]  # the run's clock: it moves when the test moves it, never with the machine's load
    monkeypatch.setattr(multi_turn, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    async def go():
        second_turns: list[httpx.Request] = []
        both_sent = asyncio.Event()

        async def answer(request: httpx.Request) -> httpx.Response:
            response = await handler(request)
            if sum(m["role"] == "user" for m in json.loads(request.content)["messages"]) == 2:
                second_turns.append(request)
                if len(second_turns) == 2:  # both in flight (a turn 3 waits on its turn 2)
                    now[0] = 1.0  # the duration passes while they run
                    both_sent.set()
                await both_sent.wait()
            return response

        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            run = RunSpec(duration=0.5)
            return await run_conversations(client, CHAT, conversations, run, think_time=0.01)

    outputs, _ = asyncio.run(go())
    # turns 2 started within the duration and were waited for; no turn 3 started after it
    assert sorted(o.turn for o in outputs) == [1, 1, 2, 2] and all(o.success for o in outputs)


def test_cli_rejects_completions_endpoint_and_bad_knobs(capsys) -> None:
    base = ["bench", "--dataset=multi-turn", "--model=m", "--base-url=http://127.0.0.1:9"]
    assert main([*base, "--endpoint=/v1/completions", "--no-progress"]) == 2
    assert "needs --endpoint /v1/chat/completions" in capsys.readouterr().err
    assert main([*base, "--multi-turn-turns=0", "--no-progress"]) == 2
    assert "multi-turn turns must be at least 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    c = ServedCluster(tiny_dir, "--num-kv-blocks=256")
    yield c
    c.stop()


def test_multi_turn_against_served_cluster(cluster, tiny_dir, tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = [
        "bench",
        f"--base-url={cluster.url}",
        "--dataset=multi-turn",
        f"--tokenizer={tiny_dir}",
        "--multi-turn-conversations=4",
        "--multi-turn-turns=3",
        "--multi-turn-system-len=40",
        "--multi-turn-user-len=8",
        "--multi-turn-output-len=6",
        "--max-concurrency=2",
        "--ignore-eos",
        "--warmup=1",
        f"--save-result={out}",
        "--save-detailed",
        "--no-progress",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    print(printed)
    assert "By turn" in printed and "\n3+ " in printed
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["endpoint"]) == (12, 0, "/v1/chat/completions")
    assert r["multi_turn"]["turns"] == 3 and r["total_output_tokens"] == 12 * 6
    pt = r["per_turn"]
    assert list(pt) == ["1", "2", "3", "3+"]
    assert [pt[k]["completed"] for k in pt] == [4, 4, 4, 4]
    # the server's prompt_tokens grow by a user message (8) and an answer each turn
    pairs = list(zip(r["input_lens"], r["turns"], strict=True))
    by_turn = {t: [n for n, u in pairs if u == t] for t in (1, 2, 3)}
    assert min(by_turn[2]) >= max(by_turn[1]) + 8 and min(by_turn[3]) >= max(by_turn[2]) + 8
    # pdserve reports cached tokens: the shared system prompt is a prefix-cache hit
    assert all(isinstance(pt[k]["cached_tokens"], int) for k in pt)
    assert pt["3"]["cached_tokens"] > 0 and r["total_cached_tokens"] > 0
    assert pt["3+"]["median_ttft_ms"] > 0 and pt["3+"]["median_tpot_ms"] > 0
    used = cluster.wait_blocks_free()
    assert used and not any(used.values())
