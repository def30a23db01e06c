"""The planner on synthetic load: exact worker counts, over simulated time where hysteresis
matters (coordinator/planner.py, coordinator/demand.py).

The profile is linear so each figure can be worked by hand: prefill 1 ms a token; a decode
step 20 ms + 2 ms a sequence at 100 tokens of context, + 4 ms a sequence at 1,000 (so
20 ms + 3 ms a sequence at 550); 1,000 KV blocks of 16 tokens a worker. Targets: TTFT 2 s,
TPOT 0.1 s; config defaults (spare 0.2, hysteresis 0.15, cool-downs 10 s up, 60 s down).
``FAST`` is the same model as a tensor-parallel group of 2 twice as fast: every prefill and
decode step takes half the time.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pdserve.coordinator.planner import Load, Planner, PlannerConfig, Targets
from pdserve.coordinator.planner_args import add_planner_args, planner_factory
from pdserve.coordinator.profile import Profile, shipped_profile

PROFILE = Profile(
    model="m",
    device="cpu",
    threads=1,
    block_size=16,
    kv_blocks=1000,
    prefill=((100, 0.1), (1000, 1.0), (2000, 2.0)),
    decode=tuple(
        (b, c, 0.02 + (0.002 if c == 100 else 0.004) * b) for c in (100, 1000) for b in (1, 8, 64)
    ),
)

FAST = replace(
    PROFILE,
    tensor_parallel_size=2,
    prefill=tuple((n, t / 2) for n, t in PROFILE.prefill),
    decode=tuple((b, c, t / 2) for b, c, t in PROFILE.decode),
)


def load(**changes: Any) -> Load:
    base = Load(
        arrival_rate=0.0,
        prompt_tokens=0.0,
        output_tokens=0.0,
        prefill_queue_tokens=0,
        decode_running=0,
        decode_waiting=0,
        kv_used_blocks=0,
        kv_total_blocks=1000,
        ttft_p90_s=None,
        tpot_p90_s=None,
        prefill_workers=1,
        decode_workers=1,
    )
    return replace(base, **changes)


BACKLOG = {"prefill_queue_tokens": 10_000, "prefill_workers": 2}
# λ = 4/s of 500-token prompts, 100 output tokens: prefill busy 4·0.5 s = 2.0 workers -> 3;
# decode b = 26 (0.02 + 0.003·26 = 0.098 s <= 0.1; KV: 1000 // blocks(600) = 26), Little:
# 4·100·0.098 = 39.2 in flight, 40 running -> 40/26 = 1.54 workers -> 2
STEADY = {"arrival_rate": 4.0, "prompt_tokens": 500.0, "output_tokens": 100.0}


def steady(**changes: Any) -> Load:
    return load(**{**STEADY, **changes})


def simulate(
    planner: Planner, at: Callable[[float], dict[str, Any]], times: range, live: tuple[int, int]
) -> list[tuple[int, int]]:
    """Plans at each time; the pools follow each plan at once (KV: 1,000 blocks a worker)."""
    out = []
    for t in times:
        p, d = live
        figures = {"prefill_workers": p, "decode_workers": d, "kv_total_blocks": 1000 * d}
        plan = planner.plan("m", load(**{**figures, **at(t)}), float(t))
        live = (plan.prefill, plan.decode)
        out.append(live)
    return out


def planner(profile: Profile | None = PROFILE, *more: Profile, **config: Any) -> Planner:
    profiles = [] if profile is None else [profile]
    return Planner([*profiles, *more], Targets(ttft_s=2.0, tpot_s=0.1), PlannerConfig(**config))


def test_steady_load_holds_its_counts() -> None:
    steady = {**STEADY, "decode_running": 40}
    plans = simulate(planner(), lambda t: steady, range(0, 600, 5), (1, 1))
    assert plans == [(3, 2)] * 120


def test_steady_plan_fields_and_reason() -> None:
    steady = load(**STEADY, decode_running=40, decode_workers=2, kv_total_blocks=2000)
    plan = planner().plan("m", steady, 0.0)
    assert (plan.prefill, plan.decode) == (3, 2)
    assert plan.reason == "prefill 3: arrivals 2.00; decode 2: running 1.54"
    assert plan.to_json() == {
        "model": "m",
        "prefill": 3,
        "decode": 2,
        "max_local_prefill_tokens": 96,
        "reason": plan.reason,
        "load": dict(steady.__dict__),
    }


def test_rising_load_scales_up_at_once() -> None:
    # λ 1, 2, 4, 8 every 30 s, 10·λ running: prefill ceil(0.6·λ); decode ceil(1.2·10λ/26)
    def at(t: float) -> dict[str, Any]:
        rate = 2 ** (t // 30)
        return {**STEADY, "arrival_rate": rate, "decode_running": int(10 * rate)}

    plans = simulate(planner(), at, range(0, 120, 10), (1, 1))
    assert plans == [(1, 1)] * 3 + [(2, 1)] * 3 + [(3, 2)] * 3 + [(5, 4)] * 3


def test_prompt_heavy_load_wants_prefill() -> None:
    # 2/s of 2,000 tokens: 4.0 prefill workers busy -> 5. Decode at context 2,005: 7 a worker
    # (KV: 1000 // blocks(2,010) = 7), step 0.02 + 7·0.00623 s; 2·10·0.0636/7 = 0.18 -> 1
    busy = load(arrival_rate=2.0, prompt_tokens=2000.0, output_tokens=10.0, decode_running=1)
    plan = planner().plan("m", busy, 0.0)
    assert (plan.prefill, plan.decode) == (5, 1)
    assert plan.reason == "prefill 5: arrivals 4.00; decode 1: arrivals 0.18"


def test_output_heavy_load_wants_decode() -> None:
    # 2/s of 50 tokens, 1,000 out: prefill 0.1 busy -> 1. Decode at context 550: KV holds 15
    # (1000 // blocks(1,050)), step 0.065 s; 2·1000·0.065/15 = 8.67 workers -> 11
    busy = load(arrival_rate=2.0, prompt_tokens=50.0, output_tokens=1000.0, decode_running=100)
    plan = planner().plan("m", busy, 0.0)
    assert (plan.prefill, plan.decode) == (1, 11)
    assert plan.reason == "prefill 1: arrivals 0.10; decode 11: arrivals 8.67"


def test_flapping_inside_the_band_never_oscillates() -> None:
    # λ 3.4 / 3.2, 90 s each (longer than the down cool-down): prefill 1.7 -> 3 workers,
    # 1.6 -> 2, but 1.6·1.15 -> 3: never a step down (without the band: down at 150, up at 180)
    def at(t: float) -> dict[str, Any]:
        return {**STEADY, "arrival_rate": 3.4 if t // 90 % 2 == 0 else 3.2}

    plans = simulate(planner(), at, range(0, 600, 5), (1, 1))
    assert [p for p, _ in plans] == [3] * 120
    flappy = simulate(planner(hysteresis=0.0), at, range(0, 200, 5), (1, 1))
    assert [p for p, _ in flappy] == [3] * 30 + [2] * 6 + [3] * 4


def test_flapping_faster_than_the_cool_down_never_scales_down() -> None:
    # λ 3.4 for 20 s, 2.0 for 20 s (prefill 1.0 -> 2 workers): never 60 s low in a row; then
    # 2.0 steadily from t = 300: one step down 60 s later (the low run began at t = 300)
    def at(t: float) -> dict[str, Any]:
        high = t < 300 and t % 40 < 20
        return {**STEADY, "arrival_rate": 3.4 if high else 2.0}

    plans = simulate(planner(), at, range(0, 600, 5), (1, 1))
    prefill = [p for p, _ in plans]
    assert prefill == [3] * 72 + [2] * 48  # t = 0..355 at 3, from t = 360 at 2


def test_cool_downs() -> None:
    # t 0: λ 2 (2 workers); t 5: λ 4 wants 3, the up cool-down holds it to t 10; from t 20
    # idle: down one at t 80, one more at t 140
    def at(t: float) -> dict[str, Any]:
        rate = 2.0 if t < 5 else 4.0 if t < 20 else 0.0
        return {**STEADY, "arrival_rate": rate}

    pl = planner()
    plans = simulate(pl, at, range(0, 200, 5), (1, 1))
    prefill = [p for p, _ in plans]
    assert prefill == [2, 2] + [3] * 14 + [2] * 12 + [1] * 12


def test_up_cool_down_reason() -> None:
    pl = planner()
    pl.plan("m", steady(arrival_rate=2.0), 0.0)
    plan = pl.plan("m", load(**STEADY, prefill_workers=2), 5.0)
    assert plan.prefill == 2
    assert plan.reason.startswith("prefill 2: arrivals 2.00 (up cool-down)")
    down = pl.plan("m", load(prefill_workers=2), 6.0)
    assert down.reason.startswith("prefill 2: min (down one in 60 s)")


def test_max_workers_splits_by_demand() -> None:
    prompt_heavy = load(arrival_rate=2.0, prompt_tokens=2000.0, output_tokens=10.0)  # (5, 1)
    output_heavy = load(arrival_rate=2.0, prompt_tokens=50.0, output_tokens=1000.0)  # (1, 11)
    # 4/s, 500 -> 200 tokens: prefill 3; decode b = 22 (KV), 4·200·0.0884/22 = 3.22 -> 4
    both = load(arrival_rate=4.0, prompt_tokens=500.0, output_tokens=200.0)
    cases = [(prompt_heavy, 4, (3, 1)), (output_heavy, 4, (1, 3)), (both, 4, (2, 2))]
    cases.append((both, 6, (3, 3)))  # 6·3/7 = 2.6 -> 3
    for busy, cap, counts in cases:
        plan = planner(max_workers=cap).plan("m", busy, 0.0)
        assert (plan.prefill, plan.decode) == counts
        assert plan.reason.endswith(f"; capped at {cap}")
    plan = planner(max_workers=7).plan("m", both, 0.0)
    assert (plan.prefill, plan.decode) == (3, 4)
    assert "capped" not in plan.reason


def test_turning_under_the_cap_waits_for_room() -> None:
    # output-heavy (1, 3 of 4), then prompt-heavy from t 5: decode steps down once a minute
    # and prefill grows into the room
    def at(t: float) -> dict[str, Any]:
        prompt, out = (50.0, 1000.0) if t < 5 else (2000.0, 10.0)
        return {"arrival_rate": 2.0, "prompt_tokens": prompt, "output_tokens": out}

    plans = simulate(planner(max_workers=4), at, range(0, 150, 5), (1, 3))
    assert plans == [(1, 3)] * 13 + [(2, 2)] * 12 + [(3, 1)] * 5


def test_live_signals_add_one_worker_not_a_runaway() -> None:
    pl = planner()
    miss = steady(arrival_rate=1.0, ttft_p90_s=3.0)  # demand 0.5 -> 1, but TTFT misses
    first = pl.plan("m", miss, 0.0)
    assert (first.prefill, first.reason.split(";")[0]) == (2, "prefill 2: ttft>slo")
    for t in (20.0, 40.0):  # the new worker still starting: live stays 1
        assert pl.plan("m", miss, t).prefill == 2
    assert pl.plan("m", replace(miss, prefill_workers=2), 60.0).prefill == 3


@pytest.mark.parametrize(
    ("changes", "spare", "counts", "why"),
    [
        ({"tpot_p90_s": 0.2}, 0.2, (1, 2), "decode 2: tpot>slo"),
        ({"kv_used_blocks": 900}, 0.2, (1, 2), "decode 2: kv 0.90"),  # 0.9·1.2 -> 2
        ({"kv_used_blocks": 900}, 0.0, (1, 2), "decode 2: kv use"),  # 0.9 -> 1, but >= 0.85
        ({"decode_waiting": 3}, 0.2, (1, 2), "decode 2: waiting"),
        # TTFT misses while requests wait for blocks and no prompt is queued: decode's doing
        ({"ttft_p90_s": 3.0, "decode_waiting": 3}, 0.2, (1, 2), "decode 2: waiting"),
        ({"ttft_p90_s": 3.0, "prefill_queue_tokens": 100}, 0.2, (2, 1), "prefill 2: ttft>slo"),
        ({"ttft_p90_s": 1.9, "tpot_p90_s": 0.1}, 0.2, (1, 1), "decode 1: min"),  # within
    ],
)
def test_live_signals(
    changes: dict[str, Any], spare: float, counts: tuple[int, int], why: str
) -> None:
    plan = planner(spare=spare).plan("m", load(**changes), 0.0)
    assert (plan.prefill, plan.decode) == counts
    assert why in plan.reason


def test_a_tpot_target_out_of_reach_does_not_buy_workers() -> None:
    # TPOT 15 ms, under one sequence's 23 ms step at 550 tokens: steps of up to 46 ms (b = 8,
    # 44 ms); 4/s: 4·100·0.044/8 = 2.2 -> 3 workers, where b = 1 would want 4·100·0.023 -> 12
    tight = Planner([PROFILE], Targets(ttft_s=2.0, tpot_s=0.015), PlannerConfig())
    plan = tight.plan("m", steady(), 0.0)
    assert plan.decode == 3
    assert plan.reason.endswith("decode 3: arrivals 2.20 (tpot out of reach)")
    # 1/s (0.55 -> 1): the TPOT miss adds no worker, no number of them would meet it
    light = tight.plan("other", steady(arrival_rate=1.0, tpot_p90_s=0.5), 0.0)
    assert light.decode == 1


def test_without_a_profile_the_live_signals_decide() -> None:
    pl = planner(profile=None)
    # 5,000 queued: 5000/2048 = 2.44 workers -> 3; KV 1,500 of 2 x 1,000 in use: 1.5 -> 2
    busy = load(prefill_queue_tokens=5000, kv_used_blocks=1500, kv_total_blocks=2000)
    plan = pl.plan("m", replace(busy, decode_workers=2), 0.0)
    assert (plan.prefill, plan.decode, plan.max_local_prefill_tokens) == (3, 2, 0)
    assert plan.reason == "prefill 3: queue 2.44; decode 2: kv 1.50"
    plan = pl.plan("m", replace(busy, decode_workers=2, tpot_p90_s=0.5), 20.0)
    assert (plan.prefill, plan.decode) == (3, 3)
    idle = [pl.plan("m", load(prefill_workers=3, decode_workers=3), t) for t in (30.0, 89.0, 90.0)]
    assert [(p.prefill, p.decode) for p in idle] == [(3, 3), (3, 3), (2, 2)]


@pytest.mark.parametrize(
    ("changes", "tokens"),
    [
        # idle: one sequence's step 22 ms leaves 78 ms, one stall a token: 78 tokens -> 64
        ({}, 64),
        # 40 running on 2 workers: step 0.08 s at 550, slack 0.02; 2/s a worker for 0.1 s:
        # 0.2 stalls a token -> 0.1 s of prefill -> 96
        ({**STEADY, "decode_running": 40, "decode_workers": 2}, 96),
        # 20 running: step 0.05 s, slack 0.05 s / 0.2 stalls a token -> 250 -> 240
        ({**STEADY, "decode_running": 20, "decode_workers": 2}, 240),
        # 0.1/s: one stall a stream (1/100 a token) -> 5 s -> the longest profiled, 2,000
        ({**STEADY, "arrival_rate": 0.1, "decode_running": 20, "decode_workers": 2}, 2000),
        # the prefill pool the bottleneck (10,000 queued on 2: 5 s > 2 s): one stall a stream
        ({**STEADY, "decode_running": 20, "decode_workers": 2, **BACKLOG}, 2000),
        ({**STEADY, "decode_running": 80, "decode_workers": 2}, 0),  # step 0.14 s > TPOT
    ],
)
def test_local_prefill_threshold(changes: dict[str, Any], tokens: int) -> None:
    assert planner().plan("m", load(**changes), 0.0).max_local_prefill_tokens == tokens


def test_local_prefill_threshold_cap_and_no_profile() -> None:
    quiet = steady(arrival_rate=0.1, decode_running=40, decode_workers=2)
    assert planner(max_local_prefill_cap=300).plan("m", quiet, 0.0).max_local_prefill_tokens == 288
    assert planner(profile=None).plan("m", quiet, 0.0).max_local_prefill_tokens == 0


def test_min_spare_and_mins() -> None:
    plan = planner(min_spare=1).plan("m", load(**STEADY, decode_running=40), 0.0)
    assert (plan.prefill, plan.decode) == (4, 3)
    idle = planner(min_spare=1, min_prefill=2, min_decode=0).plan("m", load(decode_workers=0), 0.0)
    assert (idle.prefill, idle.decode) == (2, 0)


def test_models_plan_apart() -> None:
    pl = planner()
    assert pl.plan("a", load(**STEADY), 0.0).prefill == 3
    assert pl.plan("b", load(), 1.0).prefill == 1


def test_bad_figures_are_cleaned() -> None:
    plan = planner().plan(
        "m",
        load(arrival_rate=math.nan, prompt_tokens=-5.0, decode_running=-3, ttft_p90_s=math.inf),
        0.0,
    )
    assert (plan.prefill, plan.decode) == (1, 1)
    assert (plan.load.arrival_rate, plan.load.prompt_tokens) == (0.0, 0.0)
    assert (plan.load.decode_running, plan.load.ttft_p90_s) == (0, None)
    sizes = planner().plan("m", load(prefill_tp=0, decode_tp=-2), 0.0).load
    assert (sizes.prefill_tp, sizes.decode_tp) == (1, 1)  # no size below one rank
    huge = planner().plan("m", steady(arrival_rate=1e308, prompt_tokens=1e308), 0.0)
    assert huge.prefill == 1 << 16


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PlannerConfig(spare=-0.1), "spare must be >= 0"),
        (lambda: PlannerConfig(scale_down_cooldown_s=math.nan), "scale_down_cooldown_s"),
        (lambda: PlannerConfig(max_workers=1), "below min_prefill"),
        (lambda: PlannerConfig(kv_high=0.0), "kv_high must be in"),
        (lambda: PlannerConfig(max_batch=0), "max_batch"),
        (lambda: Targets(ttft_s=0.0), "ttft_s must be a positive number"),
        (lambda: Targets(tpot_s=math.inf), "tpot_s must be a positive number"),
    ],
)
def test_bad_config_refused(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_local_prefill_never_stalls_streams_longer_than_the_ttft_target() -> None:
    """One stall a stream would allow 5 s of prefill at 0.1/s (the case above: 2,000 tokens);
    a TTFT target of 0.5 s bounds the gap every stream of the worker sees to 0.5 s: 496."""
    quiet = steady(arrival_rate=0.1, decode_running=20, decode_workers=2)
    tight = Planner([PROFILE], Targets(ttft_s=0.5, tpot_s=0.1), PlannerConfig())
    assert tight.plan("m", quiet, 0.0).max_local_prefill_tokens == 496


# ---- profiles by tensor-parallel size --------------------------------------------------------

# λ = 16/s, 5,000 prompt tokens queued: at TP 1 prefill 16·0.5 s + 5000·0.001/2 s = 10.5
# workers -> 13; decode b = 26 (KV-bound), Little: 16·100·0.098/26 = 6.03 -> 8. At TP 2 every
# figure halves: prefill 5.25 -> 7, decode 16·100·0.049/26 = 3.02 -> 4
BUSY = {**STEADY, "arrival_rate": 16.0, "prefill_queue_tokens": 5000}


@pytest.mark.parametrize(
    ("sizes", "counts", "reason"),
    [
        ((1, 1), (13, 8), "prefill 13: arrivals 10.50; decode 8: arrivals 6.03"),
        ((1, 2), (13, 4), "prefill 13: arrivals 10.50; decode 4: arrivals 3.02"),
        ((2, 1), (7, 8), "prefill 7: arrivals 5.25; decode 8: arrivals 6.03"),
        ((2, 2), (7, 4), "prefill 7: arrivals 5.25; decode 4: arrivals 3.02"),
    ],
)
def test_each_pool_is_sized_with_the_profile_at_its_tensor_parallel_size(
    sizes: tuple[int, int], counts: tuple[int, int], reason: str
) -> None:
    prefill_tp, decode_tp = sizes
    busy = load(**BUSY, prefill_tp=prefill_tp, decode_tp=decode_tp)
    plan = planner(PROFILE, FAST).plan("m", busy, 0.0)
    assert ((plan.prefill, plan.decode), plan.reason) == (counts, reason)
    assert (plan.load.prefill_tp, plan.load.decode_tp) == sizes


def test_a_size_without_a_profile_goes_by_live_signals_and_says_so() -> None:
    # TP 4: no profile; as with none, 5,000 queued tokens: 5000/2048 = 2.44 -> 3, decode idle
    plan = planner(PROFILE, FAST).plan("m", load(**BUSY, prefill_tp=4, decode_tp=4), 0.0)
    assert (plan.prefill, plan.decode, plan.max_local_prefill_tokens) == (3, 1, 0)
    assert plan.reason == (
        "prefill 3: queue 2.44 (no profile at TP 4); decode 1: min (no profile at TP 4)"
    )
    # one pool at a profiled size, the other not
    plan = planner(FAST).plan("m", load(**BUSY, prefill_tp=2, decode_tp=1), 0.0)
    assert plan.reason == "prefill 7: arrivals 5.25; decode 1: min (no profile at TP 1)"
    # a planner with no profile at all says nothing of sizes: live signals, as ever
    assert planner(None).plan("m", load(**BUSY, decode_tp=2), 0.0).reason == (
        "prefill 3: queue 2.44; decode 1: min"
    )


@pytest.mark.parametrize(("decode_tp", "tokens"), [(1, 64), (2, 176), (4, 0)])
def test_the_local_prefill_threshold_reads_the_decode_workers_profile(
    decode_tp: int, tokens: int
) -> None:
    # idle: TP 1 leaves 78 ms beside a 22 ms step: 78 tokens -> 64; TP 2 leaves 89 ms beside
    # 11 ms, at 0.5 ms a token: 178 -> 176; TP 4: no profile, no local prefill
    plan = planner(PROFILE, FAST).plan("m", load(decode_tp=decode_tp), 0.0)
    assert plan.max_local_prefill_tokens == tokens


@pytest.mark.parametrize(("prefill_tp", "tokens"), [(1, 2000), (2, 240), (4, 2000)])
def test_whether_the_prefill_pool_is_the_bottleneck_is_read_at_its_size(
    prefill_tp: int, tokens: int
) -> None:
    # 3,000 queued on one prefill worker: 3 s at TP 1 (over the 2 s TTFT: the bottleneck, one
    # stall a stream -> 2,000), 1.5 s at TP 2 (not: 240, as in test_local_prefill_threshold);
    # TP 4 has no profile: the decode workers' (TP 1) speed stands in
    busy = steady(decode_running=20, decode_workers=2, prefill_queue_tokens=3000)
    plan = planner(PROFILE, FAST).plan("m", replace(busy, prefill_tp=prefill_tp), 0.0)
    assert plan.max_local_prefill_tokens == tokens


def test_two_profiles_at_one_size_are_refused() -> None:
    with pytest.raises(ValueError, match="two profiles of 'm' at tensor-parallel size 2"):
        planner(FAST, replace(FAST, kv_blocks=10))


def _factory(paths: list[Path]) -> Callable[[str], Planner]:
    parser = argparse.ArgumentParser()
    add_planner_args(parser)
    return planner_factory(parser.parse_args([f"--profile={p}" for p in paths]))


def test_profile_flags_are_by_model_and_size(tmp_path: Path) -> None:
    files = {}
    for name, profile in {
        "m1": PROFILE,
        "m2": FAST,
        "other": replace(FAST, model="other"),
        "m1-again": replace(PROFILE, kv_blocks=10),
        "shipped-tp2": replace(FAST, model="smollm2-135m-instruct"),
        "shipped-tp1": replace(PROFILE, model="smollm2-135m-instruct"),
    }.items():
        files[name] = tmp_path / f"{name}.json"
        profile.save(files[name])
    make = _factory([files["m1"], files["m2"], files["other"]])
    assert make("m").profiles == {1: PROFILE, 2: FAST}  # one model at two sizes
    assert make("other").profiles == {2: replace(FAST, model="other")}
    assert make("unprofiled").profiles == {}
    with pytest.raises(ValueError, match="two profiles for model 'm' at tensor-parallel size 1"):
        _factory([files["m1"], files["m2"], files["m1-again"]])
    # the shipped profile (of one rank) stands at TP 1 where no flag gives one there
    shipped = shipped_profile("smollm2-135m-instruct")
    assert _factory([])("smollm2-135m-instruct").profiles == {1: shipped}
    group = _factory([files["shipped-tp2"]])("smollm2-135m-instruct").profiles
    assert group == {1: shipped, 2: replace(FAST, model="smollm2-135m-instruct")}
    given = _factory([files["shipped-tp1"]])("smollm2-135m-instruct").profiles
    assert given == {1: replace(PROFILE, model="smollm2-135m-instruct")}
