"""Benchmark workloads, arrivals and sweeps: lengths, groups, burst times, rates."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from pdserve.bench import datasets as ds
from pdserve.bench.arrivals import arrival_offsets, parse_rate, schedule
from pdserve.bench.prompts import TokenPrompts, WordPrompts, calibrate, load_tokenizer
from pdserve.bench.sweep import best_rate, parse_rates, rates_between


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_token_prompts_are_exactly_n_tokens(tiny_dir) -> None:
    maker = TokenPrompts(load_tokenizer(tiny_dir))
    tok = maker.tokenizer
    g = rng()
    for n in (1, 2, 17, 64, 300):
        for _ in range(5):
            text = maker.text(n, g)
            assert len(tok.encode(text, add_special_tokens=False).ids) == n
    special = set(tok.get_added_tokens_decoder())
    assert special and not special & set(maker.ids.tolist())


def test_word_prompts_and_calibration() -> None:
    words = WordPrompts(2.0)
    assert len(words.text(64, rng()).split()) == 32
    assert len(words.text(1, rng()).split()) == 1
    assert words.count("a b c") == 6
    seen: list[str] = []

    async def server(text: str) -> int:  # a chat template's 11 tokens plus 1.5 per word
        seen.append(text)
        return 11 + round(1.5 * len(text.split()))

    assert asyncio.run(calibrate(server)) == 1.5
    assert [len(t.split()) for t in seen] == [32, 288]

    async def no_usage(text: str) -> None:
        return None

    with pytest.raises(ValueError, match="no usage"):
        asyncio.run(calibrate(no_usage))


def test_random_lengths_and_range_ratio() -> None:
    reqs = ds.random_requests(WordPrompts(1.0), 200, 100, 20, 0.0, rng())
    assert {(r.prompt_len, r.max_tokens) for r in reqs} == {(100, 20)}
    assert {len(r.prompt.split()) for r in reqs} == {100}
    reqs = ds.random_requests(WordPrompts(1.0), 2000, 100, 20, 0.5, rng())
    ins, outs = [r.prompt_len for r in reqs], [r.max_tokens for r in reqs]
    assert (min(ins), max(ins), min(outs), max(outs)) == (50, 150, 10, 30)
    with pytest.raises(ValueError, match="range ratio"):
        ds.lengths(rng(), 1, 10, 1.0)


def test_shared_prefix_groups() -> None:
    reqs = ds.shared_prefix_requests(WordPrompts(1.0), 12, 3, 40, 8, 4, 0.0, rng())
    groups: dict[str, int] = {}
    for r in reqs:
        groups[r.system] = groups.get(r.system, 0) + 1
    assert sorted(groups.values()) == [4, 4, 4]
    assert {len(s.split()) for s in groups} == {40}
    assert {r.prompt_len for r in reqs} == {48}
    assert len({r.prompt for r in reqs}) == 12
    assert [r.system for r in reqs] != [r.system for r in sorted(reqs, key=lambda r: r.system)]


def test_mixed_streams_and_bursts() -> None:
    spec = ds.MixedSpec(8, 64, 200, 4, burst_size=3, burst_interval=2.0)
    reqs = ds.mixed_requests(WordPrompts(1.0), 10, spec, 5.0, rng())
    streams = [r for r in reqs if r.kind == "stream"]
    bursts = [r for r in reqs if r.kind == "burst"]
    assert len(streams) == 10 and {(r.prompt_len, r.max_tokens, r.at) for r in streams} == {
        (8, 64, None)
    }
    assert [r.at for r in bursts] == [2.0] * 3 + [4.0] * 3
    assert {(r.prompt_len, r.max_tokens) for r in bursts} == {(200, 4)}
    assert ds.burst_times(spec, 0.0) == [2.0]  # always one burst
    timed = schedule(reqs, 4.0, 1.0, rng())
    times = [t for t, _ in timed]
    assert times == sorted(times) and times[0] == 0.0
    assert [t for t, r in timed if r.kind == "burst"] == [2.0] * 3 + [4.0] * 3


def test_arrivals_rate_and_burstiness() -> None:
    assert arrival_offsets(3, math.inf, 1.0, rng()) == [0.0, 0.0, 0.0]
    for shape, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):
        offsets = arrival_offsets(20001, 4.0, shape, rng(1))
        gaps = np.diff(offsets)
        assert offsets[0] == 0.0 and len(gaps) == 20000
        assert gaps.mean() == pytest.approx(0.25, rel=0.03)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
    assert parse_rate("inf") == math.inf
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(2, 1.0, 0.0, rng())


def test_jsonl(tmp_path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [
        {"prompt": "a b c", "max_tokens": 5},
        {"messages": [{"role": "user", "content": "d e"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = ds.jsonl_requests(path, 7, WordPrompts(1.0))
    assert [(r.prompt, r.max_tokens, r.prompt_len, r.messages) for r in reqs] == [
        ("a b c", 5, 3, None),
        ("", 7, 2, ({"role": "user", "content": "d e"},)),
    ]
    for line, message in (
        ('{"prompt": "x"', ":1: not JSON"),
        ('{"prompt": "x", "messages": []}', "exactly one of"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ('{"messages": [{"role": "user"}]}', "string content"),
    ):
        path.write_text(line + "\n")
        with pytest.raises(ValueError, match=message):
            ds.jsonl_requests(path, 7)


def test_sweep_rates() -> None:
    assert parse_rates("1,2, 4,inf") == [1.0, 2.0, 4.0, math.inf]
    with pytest.raises(ValueError, match="--request-rate"):
        parse_rates("1,x")
    assert rates_between(1.0, 5.0, 3) == [2.0, 3.0, 4.0]
    assert rates_between(5.0, 5.0, 3) == []
    rows = [
        {"rate": 1.0, "slo_attainment": 1.0},
        {"rate": 2.0, "slo_attainment": 0.9},
        {"rate": 4.0, "slo_attainment": 0.89},
        {"rate": 8.0, "slo_attainment": None},
    ]
    assert best_rate(rows) == 2.0
    assert best_rate(rows[2:]) is None
