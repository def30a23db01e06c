"""The simulator's check against the real runs (bench/experiments/sim_validate.py): the host
calibration's arithmetic worked by hand, the replayed workloads against what the real runs
sent, a reduced replay end to end, and the committed report's shape."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.experiments import sim_replays as r
from pdserve.bench.experiments.sim_clients import Conversations, Stages
from pdserve.bench.experiments.sim_validate import validate
from pdserve.bench.experiments.sim_validate_experiments import (
    DVC_COMPARISONS,
    DVC_FIGURES,
    KV_FIGURES,
    RESULTS,
    STALL_ARMS,
)
from pdserve.bench.experiments.sim_validate_records import AIM_P50, AIM_TAIL, aim
from pdserve.bench.experiments.sim_validate_report import markdown
from pdserve.coordinator.profile import Profile
from pdserve.sim.calibrate import (
    decode_at,
    decode_scale,
    host_scales,
    prefill_at,
    prefill_scale,
    scale_profile,
)
from pdserve.sim.request import SimRequest
from pdserve.sim.results import Outcome

EXPERIMENTS = ("disagg_vs_colocated", "stall_gap", "kv_routing", "autoscale_trace")


def toy() -> Profile:
    """Prefill 10 ms + 1 ms a token; decode 20 ms + 5 ms a sequence, whatever the context."""
    return Profile(
        model="t",
        device="cpu",
        threads=1,
        block_size=16,
        kv_blocks=100,
        prefill=((10, 0.020), (110, 0.120)),
        decode=((1, 0, 0.025), (11, 0, 0.075), (1, 1000, 0.025)),
    )


# ---- calibration ------------------------------------------------------------------------------
def test_scale_profile_multiplies_each_phase_and_says_so() -> None:
    p = scale_profile(toy(), prefill=2.0, decode=3.0)
    assert [n for n, _ in p.prefill] == [10, 110]
    assert [t for _, t in p.prefill] == pytest.approx([0.040, 0.240])
    assert [(b, c) for b, c, _ in p.decode] == [(1, 0), (11, 0), (1, 1000)]
    assert [t for _, _, t in p.decode] == pytest.approx([0.075, 0.225, 0.075])
    assert p.kv_blocks == 100 and p.is_derived
    assert "prefill x2.000, decode x3.000" in p.derived
    with pytest.raises(ValueError, match="decode scale"):
        scale_profile(toy(), decode=0.0)
    with pytest.raises(ValueError, match="prefill scale"):
        scale_profile(toy(), prefill=math.nan)


def test_fractional_means_interpolate_between_whole_sizes() -> None:
    assert decode_at(toy(), 2.5, 0) == pytest.approx(0.0325)  # 25 ms + 1.5 x 5 ms
    assert prefill_at(toy(), 20.5) == pytest.approx(0.0305)  # 10 ms + 20.5 x 1 ms


def test_decode_scale_is_seconds_seen_over_seconds_the_profile_says() -> None:
    # worker a: 10 steps of batch 3 (35 ms each by the profile) took 0.70 s: 2x
    # worker b: 10 steps of batch 1 (25 ms) took 0.75 s: 3x; pooled by seconds: 1.45 / 0.60
    a = {"decode:seconds_count": 10, "decode:seconds_sum": 0.70, "decode:decode_seqs_sum": 30}
    b = {"decode:seconds_count": 10, "decode:seconds_sum": 0.75, "decode:decode_seqs_sum": 10}
    assert decode_scale([a], toy(), 0) == pytest.approx(2.0)
    assert decode_scale([a, b], toy(), 0) == pytest.approx(1.45 / 0.60)
    with pytest.raises(ValueError, match="no decode-only steps"):
        decode_scale([{"prefill:seconds_count": 3}], toy(), 0)


def test_prefill_scale_counts_mixed_steps_past_their_decodes() -> None:
    # prefill-only: 4 steps of 50 tokens (60 ms each) took 0.48 s (0.24 by the profile)
    # mixed: 5 steps of 30 tokens beside 3 decodes at decode scale 2; the simulator's step
    #   2·35 + p·40 − 2·25 ms, so 0.5 s seen is p·0.2 = 0.5 − 5·(70 − 50) ms = 0.4: p = 2
    only = {
        "prefill:seconds_count": 4,
        "prefill:seconds_sum": 0.48,
        "prefill:prefill_tokens_sum": 200,
    }
    mixed = {
        "mixed:seconds_count": 5,
        "mixed:seconds_sum": 0.5,
        "mixed:prefill_tokens_sum": 150,
        "mixed:decode_seqs_sum": 15,
    }
    assert prefill_scale([only], toy(), 2.0, 0) == pytest.approx(2.0)
    assert prefill_scale([mixed], toy(), 2.0, 0) == pytest.approx(2.0)
    assert prefill_scale([only, mixed], toy(), 2.0, 0) == pytest.approx((0.48 + 0.4) / 0.44)
    with pytest.raises(ValueError, match="no steps with prompt tokens"):
        prefill_scale([{"decode:seconds_count": 1}], toy(), 1.0, 0)


def test_host_scales_pairs_the_two() -> None:
    counters = {
        "decode:seconds_count": 10,
        "decode:seconds_sum": 0.75,
        "decode:decode_seqs_sum": 10,
        "prefill:seconds_count": 1,
        "prefill:seconds_sum": 0.06,
        "prefill:prefill_tokens_sum": 50,
    }
    assert host_scales([counters], toy(), 0) == pytest.approx((1.0, 3.0))


def test_a_scaled_profile_reproduces_the_counters_it_came_from() -> None:
    """The committed stall-gap run: its decode-only steps, priced by the profile its own
    scales make, add up to the seconds the worker counted."""
    data = json.loads((RESULTS / "stall_gap.json").read_text())
    workers = [x["steps"]["decode-0"] for rounds in data["rounds"].values() for x in rounds]
    profile = Profile.load(RESULTS / "sim_profile_smollm2-135m-instruct.json")
    _, decode = host_scales(workers, profile, 96)
    scaled = scale_profile(profile, decode=decode)
    priced = sum(
        w["decode:seconds_count"]
        * decode_at(scaled, w["decode:decode_seqs_sum"] / w["decode:seconds_count"], 96)
        for w in workers
    )
    assert priced == pytest.approx(sum(w["decode:seconds_sum"] for w in workers))


# ---- the replayed workloads -------------------------------------------------------------------
def test_mixed_workload_sends_what_each_real_rate_sent() -> None:
    data = json.loads((RESULTS / "disagg_vs_colocated_smollm2-135m-instruct.json").read_text())
    w = data["workload"]
    for i, row in enumerate(data["rows"]):
        sent = r.mixed_workload(w, row["rate"], i)
        real = row["disagg"]["rounds"][0]
        assert len(sent) == real["num_prompts"]
        assert sum(q.prompt_tokens for q in sent) == real["total_input_tokens"]
        assert [q.arrival_s for q in sent if q.kind == "burst"] == [4.0, 8.0, 12.0, 16.0]
        assert all(q.arrival_s < w["duration"] for q in sent)


def test_stages_start_each_rate_once_the_one_before_is_back() -> None:
    one = SimRequest(0.0, 8, 2)
    later = SimRequest(1.5, 8, 2)
    stages = Stages([one, one], [[one], [one, later]])
    first = stages.first()
    assert [stages.stage_of[id(q)] for q in first] == [-1, -1]
    assert stages.follow(Outcome(first[0]), 3.0) == []
    sent = stages.follow(Outcome(first[1]), 4.0)
    assert [(q.arrival_s, stages.stage_of[id(q)]) for q in sent] == [(4.0, 0)]
    sent = stages.follow(Outcome(sent[0]), 9.0)
    assert [(q.arrival_s, stages.stage_of[id(q)]) for q in sent] == [(9.0, 1), (10.5, 1)]
    assert stages.follow(Outcome(sent[0]), 10.0) == []
    assert stages.follow(Outcome(sent[1]), 12.0) == []  # no stage left


def test_conversations_prompts_match_the_real_runs_usage() -> None:
    """ChatML frames around system 256, user 64, answers 32: turns 3 and 4 of 16
    conversations within 1% of the prompt tokens the real runs' usage counted."""
    data = json.loads((RESULTS / "kv_routing_smollm2-135m-instruct.json").read_text())
    w = data["workload"]
    convs = Conversations(16, 4, 256, 64, 32, 8, 4)
    assert [convs.prompt_tokens(t) for t in (1, 2, 3, 4)] == [333, 439, 545, 651]
    ours = w["conversations"] * (convs.prompt_tokens(3) + convs.prompt_tokens(4))
    for run in data["runs"]:
        assert ours == pytest.approx(run["prompt_tokens"], rel=0.01)


def test_conversations_run_a_closed_loop_after_the_warmup() -> None:
    convs = Conversations(3, 2, 16, 8, 4, concurrency=2, warmup=1)
    (warm,) = convs.first()
    assert warm.kind == "warmup" and warm.prefixes[0][0] == "warm"
    started = convs.follow(Outcome(warm), 1.0)
    assert [(q.key, q.arrival_s) for q in started] == [("c0t1", 1.0), ("c1t1", 1.0)]
    (turn2,) = convs.follow(Outcome(started[0]), 2.0)
    assert turn2.key == "c0t2" and turn2.prompt_tokens == convs.prompt_tokens(2)
    # its prefixes: the system prompt through the first user header, then turn 1 and its answer
    assert turn2.prefixes == (("system", 24), ("c0t1", convs.prompt_tokens(1) + 3))
    (third,) = convs.follow(Outcome(turn2), 3.0)  # c0 done: its slot goes to c2
    assert third.key == "c2t1"
    failed = Outcome(started[1])
    failed.failed = "boom"
    assert convs.follow(failed, 4.0) == []  # a failed turn ends c1; no conversation is left


# ---- the report -------------------------------------------------------------------------------
def test_aims_by_kind_of_figure() -> None:
    assert [aim(n) for n in ("ttft_p50_ms", "prompt_ttft_first_ms", "cached_fraction")] == [
        AIM_P50
    ] * 3
    assert [aim(n) for n in ("tpot_p99_ms", "gap_max_ms", "goodput_rps", "attainment")] == [
        AIM_TAIL
    ] * 4


def check_shape(report: dict[str, Any], rates: int, trace: bool) -> None:
    exps = EXPERIMENTS if trace else EXPERIMENTS[:3]
    assert tuple(report["experiments"]) == exps
    for e in report["experiments"].values():
        assert e["scales"]["prefill"] > 0 and e["scales"]["decode"] > 0 and e["scales"]["from"]
    figures = report["figures"]
    expected = rates * len(r.DVC_ARMS) * len(DVC_FIGURES) + 5 * len(STALL_ARMS)
    expected += 2 * len(KV_FIGURES) + (7 if trace else 0)
    assert len(figures) == expected
    for f in figures:
        assert f["experiment"] in exps
        assert isinstance(f["real"], float | int) and isinstance(f["sim"], float | int)
        assert f["within"] == (abs(f["error"]) <= f["aim"])
        assert len(f["real_rounds"]) >= 2
    comps = report["comparisons"]
    assert len(comps) == rates * len(DVC_COMPARISONS) + 5 + len(KV_FIGURES) + (2 if trace else 0)
    for c in comps:
        assert c["real_winner"] in c["arms"]
        if c["sim"] is None:
            assert c["experiment"] == "autoscale_trace" and c["same"] is None
        else:
            assert c["same"] == (c["sim_winner"] == c["real_winner"])
    s = report["summary"]
    assert s["figures"] == len(figures)
    assert s["within"] == sum(f["within"] for f in figures)
    assert s["comparisons"] + s["not_replayed_comparisons"] == len(comps)


def test_a_reduced_replay_end_to_end() -> None:
    """One rate of disagg_vs_colocated, the stall gap and kv routing: every figure real and
    simulated, every comparison with both winners, and the markdown says each."""
    report = validate(rates=1, with_trace=False)
    check_shape(report, rates=1, trace=False)
    text = markdown(report)
    for c in report["comparisons"]:
        assert f"| {c['experiment']} | {c['case']} | {c['figure']} |" in text
    assert "## Where it misses and why" in text


def committed() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / "sim_validation.json").read_text())
    return data


def test_the_committed_report_has_every_experiment_figure_and_comparison() -> None:
    check_shape(committed(), rates=3, trace=True)
    for suffix in (".md", ".png"):
        assert (RESULTS / f"sim_validation{suffix}").stat().st_size > 1000


def test_the_committed_real_figures_are_the_real_runs() -> None:
    """The report's real side, read back from the runs it names (a replay cannot change it)."""
    dvc = json.loads((RESULTS / "disagg_vs_colocated_smollm2-135m-instruct.json").read_text())
    rows = {f"{row['rate']:g}/s": row for row in dvc["rows"]}
    for f in committed()["figures"]:
        if f["experiment"] != "disagg_vs_colocated":
            continue
        rate, arm = f["case"].split(" ")
        assert f["real"] == rows[rate][arm][DVC_FIGURES[f["figure"]]]


def test_the_committed_markdown_is_this_reports() -> None:
    text = (RESULTS / "sim_validation.md").read_text()
    assert text == markdown(committed())
    assert Path(RESULTS / "sim_profile_smollm2-135m-instruct.json").is_file()
