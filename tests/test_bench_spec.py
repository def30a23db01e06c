"""The speculative-decoding benchmark's pure parts (bench/experiments/spec_speed.py): the copy
workload's passages and typos, the /metrics deltas, the ratios against off and the aims. No
servers."""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.bench.experiments.spec_speed import spec_counters, spec_figures
from pdserve.bench.experiments.spec_speed_report import aims, noise, summarize
from pdserve.bench.experiments.spec_workloads import (
    add_typos,
    passages,
    prose_paragraphs,
    requests_per_stream,
    workload,
)

METRICS = """\
# HELP pdserve_worker_spec_drafted_tokens_total Draft tokens
pdserve_worker_spec_drafted_tokens_total{role="both",worker="decode-0",position="1"} 10.0
pdserve_worker_spec_drafted_tokens_total{role="both",worker="decode-0",position="2"} 8.0
pdserve_worker_spec_accepted_tokens_total{role="both",worker="decode-0",position="1"} 8.0
pdserve_worker_spec_accepted_tokens_total{role="both",worker="decode-0",position="2"} 4.0
pdserve_worker_spec_steps_total{role="both",worker="decode-0",reason="speculated"} 10.0
pdserve_worker_spec_steps_total{role="both",worker="decode-0",reason="not_worth"} 6.0
pdserve_worker_spec_draft_tokens_total{role="both",worker="decode-0"} 3.0
pdserve_worker_step_seconds_count{role="both",worker="decode-0",kind="decode"} 20
pdserve_worker_step_seconds_count{role="both",worker="decode-0",kind="prefill"} 2
pdserve_worker_step_seconds_sum{role="both",worker="decode-0",kind="decode"} 1.5
"""


def test_prose_paragraphs_skip_code_tables_and_headings() -> None:
    text = "\n".join(
        [
            "# A heading that is long enough to be a paragraph if it were one at all",
            "",
            "First line of prose that goes on for a while, and",
            "its second line, so the paragraph has enough words in it.",
            "",
            "```sh",
            "pdserve serve --model tiny and more words that are code and not prose at all",
            "```",
            "| a | table | row | with | many | cells | that | are | not | prose | here | x |",
            "",
            "    an indented block of code that has more than twelve words in it, surely",
            "",
            "short one",
        ]
    )
    assert prose_paragraphs(text) == [
        "First line of prose that goes on for a while, and its second line, so the "
        "paragraph has enough words in it."
    ]


def test_passages_are_whole_sentences_within_bounds() -> None:
    sentence = "one two three four five six seven eight nine ten."  # 10 words
    paragraphs = [" ".join([sentence] * 4)] * 5  # 40 words each
    out = passages(paragraphs, lo=50, hi=100)
    # paragraphs join until >= 50 words: two of 40 (80 words) each time
    assert [len(p.split()) for p in out] == [80, 80]
    assert all(p.count("\n\n") == 1 and p.endswith(".") for p in out)
    # a paragraph longer than hi is cut between sentences; a tail under lo is dropped
    long = [" ".join([sentence] * 25)]
    assert [len(p.split()) for p in passages(long, lo=50, hi=100)] == [100, 100, 50]
    assert [len(p.split()) for p in passages(long, lo=60, hi=100)] == [100, 100]


def test_typos_swap_inner_letters_and_are_seeded() -> None:
    text = "speculative decoding verifies several drafted tokens within one forward pass"
    a = add_typos(text, np.random.default_rng(3), share=0.5)
    assert a == add_typos(text, np.random.default_rng(3), share=0.5)
    changed = [(x, y) for x, y in zip(text.split(), a.split(), strict=True) if x != y]
    assert changed
    for x, y in changed:
        assert sorted(x) == sorted(y) and x[0] == y[0] and x[-1] == y[-1]


def test_workloads_are_deterministic_and_sized() -> None:
    found = [("a", f"passage number {i} " * 60) for i in range(5)]
    one = workload("copy", found, 7, 16, seed=1)
    assert one == workload("copy", found, 7, 16, seed=1)
    assert len(one) == 7 and all(r.max_tokens == 16 and r.messages for r in one)
    assert all(r.kind.startswith("copy-") for r in one)
    chat = workload("chat", [], 50, 8, seed=2)  # more than the questions: they repeat
    assert len(chat) == 50 and len({r.prompt for r in chat}) == 40
    assert [requests_per_stream(c) for c in (1, 8, 32, 64)] == [4, 3, 2, 2]


def test_spec_counters_and_their_deltas() -> None:
    after = spec_counters(METRICS)
    assert after == {
        "drafted:1": 10.0,
        "drafted:2": 8.0,
        "accepted:1": 8.0,
        "accepted:2": 4.0,
        "steps:speculated": 10.0,
        "steps:not_worth": 6.0,
        "draft_tokens": 3.0,
        "steps:all": 22.0,
        "steps:seconds": 1.5,
    }
    before = {"drafted:1": 2.0, "accepted:1": 2.0, "steps:speculated": 2.0, "steps:all": 2.0}
    figures = spec_figures(before, after)
    assert figures["drafted"] == [8.0, 8.0] and figures["accepted"] == [6.0, 4.0]
    assert figures["acceptance"] == 10 / 16
    assert figures["steps"] == {"speculated": 8.0, "not_worth": 6.0}
    assert figures["speculated_share"] == 8 / 14
    assert figures["engine_steps"] == 20.0 and figures["mean_step_ms"] == 1.5 / 20 * 1e3
    # the off arm: no spec metrics at all
    off = spec_figures({"steps:all": 5.0}, {"steps:all": 9.0})
    assert off["acceptance"] is None and off["speculated_share"] is None


def _run(rnd: int, arm: str, w: str, c: int, tpot: float, tps: float) -> dict[str, Any]:
    return {
        "round": rnd,
        "arm": arm,
        "workload": w,
        "streams": c,
        "tpot_ms": tpot,
        "ttft_ms": 10.0,
        "tokens_per_s": tps,
        "acceptance": None if arm == "off" else 0.5,
        "speculated_share": None if arm == "off" else 1.0,
        "mean_output_tokens": 32.0,
        "mean_step_ms": 5.0,
        "failed": 0,
        "drafted": [] if arm == "off" else [4.0, 2.0],
        "accepted": [] if arm == "off" else [2.0, 1.0],
    }


def test_summary_ratios_and_aims() -> None:
    runs = []
    for rnd, (off, ngram) in enumerate([(40.0, 20.0), (44.0, 20.0), (42.0, 30.0)]):
        for w in ("copy", "chat"):
            runs.append(_run(rnd, "off", w, 1, off, 1000 / off))
            runs.append(_run(rnd, "ngram", w, 1, ngram, 1000 / ngram))
    summary = summarize(runs, ["off", "ngram"], [1])
    ngram = summary["copy"]["1"]["ngram"]
    assert ngram["tpot_ms"] == 20.0
    assert ngram["tpot_speedup"]["rounds"] == [2.0, 2.2, 1.4]
    assert ngram["tpot_speedup"]["median"] == 2.0 and ngram["tpot_speedup"]["min"] == 1.4
    assert ngram["tps_ratio"]["median"] == 2.0
    assert ngram["position_acceptance"] == [0.5, 0.5]
    assert "tpot_speedup" not in summary["copy"]["1"]["off"]
    got = aims(summary, [1])
    assert [status for _, status, _ in got] == ["PASS", "PASS", "PASS"]
    assert "2.00x (1.40-2.20)" in got[0][2]
    assert "(the aim is at 32 streams)" in got[2][0]
    # chat 10% slower than off at 1 stream: the second aim misses
    slow = [
        {**r, "tpot_ms": 44.0} if (r["arm"], r["workload"]) == ("ngram", "chat") else r
        for r in runs
    ]
    slow = [
        {**r, "tpot_ms": 40.0} if (r["arm"], r["workload"]) == ("off", "chat") else r for r in slow
    ]
    assert aims(summarize(slow, ["off", "ngram"], [1]), [1])[1][1] == "MISS"
    # without the off arm nothing can be compared
    alone = summarize([r for r in runs if r["arm"] == "ngram"], ["ngram"], [1])
    assert [status for _, status, _ in aims(alone, [1])] == ["n/a", "n/a", "n/a"]


def test_noise_names_the_levels_other_processes_disturbed() -> None:
    runs = [_run(0, "off", "chat", 8, 30.0, 200.0), _run(1, "draft", "copy", 1, 30.0, 200.0)]
    runs[0]["other_cpu_share"], runs[1]["other_cpu_share"] = 0.02, 0.4
    assert noise(runs) == (
        "other processes took a median 21% of the CPUs during a level, at most 40%; "
        "over 10% in: copy 1 draft round 2"
    )
    assert noise([_run(0, "off", "chat", 8, 30.0, 200.0)]) == "other processes' CPU not measured"
