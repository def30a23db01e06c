"""sim/ workloads: specs drawn into requests (deterministic by seed, the bench's arrival times
and burst times), multi-turn prefixes, traces (CSV and bench results), and every bad input
named by its field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.datasets import MixedSpec, burst_times
from pdserve.bench.metrics import RequestOutput, detail
from pdserve.sim.lengths import Fixed, LogNormal, Uniform
from pdserve.sim.patterns import Burst
from pdserve.sim.request import SimRequest
from pdserve.sim.trace import Trace
from pdserve.sim.workload import WorkloadSpec, load_workload, parse_compact, spec_from_json


def spec(**fields: object) -> WorkloadSpec:
    return spec_from_json({"rate": 10, "duration_s": 5, "prompt": 100, "output": 10, **fields})


# --- distributions ---


def test_lognormal_mean_is_the_distributions_own() -> None:
    wide = LogNormal(512, 1.0, 10**7)
    drawn = wide.sample(np.random.default_rng(0), 400_000)
    assert drawn.dtype == np.int64 and drawn.min() >= 1
    assert abs(drawn.mean() / 512 - 1) < 0.01
    assert abs(wide.expected() / 512 - 1) < 1e-3  # the clamp at 1e7 is far out
    capped = LogNormal(512, 1.0, 600)  # clamped hard: expected() is the clamped mean
    drawn = capped.sample(np.random.default_rng(1), 400_000)
    assert drawn.max() == 600
    assert capped.expected() < 450
    assert abs(drawn.mean() / capped.expected() - 1) < 0.005


def test_fixed_and_uniform_bounds() -> None:
    rng = np.random.default_rng(0)
    assert Fixed(7).sample(rng, 5).tolist() == [7] * 5
    drawn = Uniform(3, 6).sample(rng, 10_000)
    assert set(drawn.tolist()) == {3, 4, 5, 6}
    assert Uniform(3, 6).expected() == 4.5
    assert Uniform(5, 5).sample(rng, 3).tolist() == [5, 5, 5]


# --- generated streams ---


def test_same_seed_same_requests() -> None:
    w = parse_compact("rate=50,duration=4,prompt=lognormal:200:1.0:2000,output=uniform:5:50")
    assert w.requests() == w.requests()
    assert w.requests() != w.requests(seed=1)
    assert (
        w.requests(seed=1)
        == spec_from_json(
            {
                "rate": 50,
                "duration_s": 4,
                "prompt": "lognormal:200:1:2000",
                "output": "uniform:5:50",
                "seed": 1,
            }
        ).requests()
    )


def test_arrivals_are_the_benchs_for_the_seed() -> None:
    for burstiness in (1.0, 0.5):
        w = spec(rate=20, duration_s=None, requests=300, burstiness=burstiness, seed=3)
        bench = arrival_offsets(300, 20, burstiness, np.random.default_rng(3))
        assert [r.arrival_s for r in w.requests()] == bench
    # a duration: the bench's arrivals (it draws 1.5x more) that fall before it
    w = spec(rate=20, duration_s=30, seed=4)
    bench = arrival_offsets(1000, 20, 1.0, np.random.default_rng(4))
    times = [r.arrival_s for r in w.requests()]
    assert times == [t for t in bench if t < 30]
    assert all(r.kind == "stream" for r in w.requests())


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_burstiness_is_the_gaps_gamma_shape(shape: float) -> None:
    w = spec(rate=100, duration_s=None, requests=40_000, burstiness=shape)
    gaps = np.diff([r.arrival_s for r in w.requests()])
    assert abs(gaps.mean() * 100 - 1) < 0.03
    cv = gaps.std() / gaps.mean()
    assert abs(cv * math.sqrt(shape) - 1) < 0.05  # a gamma's CV is 1 / sqrt(shape)


@pytest.mark.parametrize("horizon", [0.5, 4.99, 5.0, 12.0, 31.7])
def test_burst_times_are_the_benchs(horizon: float) -> None:
    bench = burst_times(MixedSpec(burst_interval=5.0, burst_size=4), horizon)
    assert Burst(5.0, 4, Fixed(1024), Fixed(16)).times(horizon) == bench


def test_bursts_within_the_run() -> None:
    burst = {"every_s": 5, "size": 3, "prompt": 1024, "output": 16}
    got = [r for r in spec(duration_s=12, bursts=[burst]).requests() if r.kind == "burst"]
    assert [r.arrival_s for r in got] == [5.0] * 3 + [10.0] * 3
    assert {(r.prompt_tokens, r.output_tokens) for r in got} == {(1024, 16)}
    # the bench sends nothing from its duration on: a burst at exactly 10 s of 10 is not sent
    got = [r for r in spec(duration_s=10, bursts=[burst]).requests() if r.kind == "burst"]
    assert [r.arrival_s for r in got] == [5.0] * 3
    # with requests instead, the horizon is requests / rate (bench), at least one burst
    w = spec(duration_s=None, requests=20, bursts=[burst])
    assert [r.arrival_s for r in w.requests() if r.kind == "burst"] == [5.0] * 3
    started = spec(duration_s=12, bursts=[{**burst, "start_s": 0.5, "size": 1}])
    assert [r.arrival_s for r in started.requests() if r.kind == "burst"] == [0.5, 5.5, 10.5]


def test_shared_prefix_groups_used_evenly() -> None:
    w = spec(
        duration_s=None,
        requests=400,
        prompt="uniform:10:20",
        shared_prefix={"groups": 4, "tokens": 100},
    )
    reqs = w.requests()
    counts: dict[str, int] = {}
    for r in reqs:
        ((key, tokens),) = r.prefixes
        assert tokens == 100 and 110 <= r.prompt_tokens <= 120
        counts[key] = counts.get(key, 0) + 1
    assert counts == {"group0": 100, "group1": 100, "group2": 100, "group3": 100}
    in_order = [f"group{i % 4}" for i in range(8)]
    assert [r.prefixes[0][0] for r in reqs[:8]] != in_order  # shuffled, as the bench does
    assert w.mean_prompt_tokens() == 115


def test_tier_shares() -> None:
    tiers = [{"tier": 0, "share": 0.2}, {"tier": 3, "share": 0.8}]
    reqs = spec(duration_s=None, requests=20_000, tiers=tiers).requests()
    top = sum(r.tier == 0 for r in reqs) / len(reqs)
    assert abs(top - 0.2) < 0.015
    assert {r.tier for r in reqs} == {0, 3}


# --- multi-turn ---

MULTI = {
    "conversations": 2,
    "turns": 3,
    "system_tokens": 10,
    "user": 5,
    "output": 7,
    "turn_gap_s": 1.0,
    "think_s": 0.5,
}


def test_multi_turn_prefixes_and_keys() -> None:
    w = spec_from_json({"rate": 1e6, "seed": 2, "multi_turn": MULTI})
    starts = arrival_offsets(2, 1e6, 1.0, np.random.default_rng(2))
    expected = []
    for c, start in enumerate(starts):
        for k, (prompt, before) in enumerate([(15, None), (27, 22), (39, 34)], 1):
            prefixes = (("sys", 10),) + (((f"conv{c}/t{k - 1}", before),) if before else ())
            expected.append(
                SimRequest(
                    start + 1.5 * (k - 1), prompt, 7, prefixes, f"conv{c}/t{k}", kind="multi-turn"
                )
            )
    assert w.requests() == sorted(expected, key=lambda r: r.arrival_s)
    # its own system prompt per conversation: no shared prefix; a duration cuts turn 3
    own = spec_from_json(
        {"rate": 1e6, "seed": 2, "duration_s": 2, "multi_turn": {**MULTI, "shared_system": False}}
    ).requests()
    assert [(r.key, r.prefixes) for r in own if r.key and r.key.startswith("conv0")] == [
        ("conv0/t1", ()),
        ("conv0/t2", (("conv0/t1", 22),)),
    ]
    assert w.mean_prompt_tokens() == 27 and w.mean_output_tokens() == 7
    assert w.request_rate() == 3e6


def test_multi_turn_concurrency_holds_a_slot_for_the_span() -> None:
    mt = {**MULTI, "conversations": 3, "turns": 2, "think_s": 0, "concurrency": 2}
    w = spec_from_json({"rate": 1e6, "multi_turn": mt})
    firsts = [r.arrival_s for r in w.requests() if r.key and r.key.endswith("/t1")]
    assert firsts[0] == 0 and firsts[1] < 1e-4 and firsts[2] == 2.0  # conv0's span: 2 x 1 s
    assert w.request_rate() == 2 / 2 * 2  # 2 conversations per 2 s span, 2 turns each


def test_multi_turn_reproduces_the_kv_routing_bench() -> None:
    root = Path(__file__).resolve().parents[1]
    run = json.loads((root / "bench/results/kv_routing_smollm2-135m-instruct.json").read_text())
    wl = run["workload"]
    w = spec_from_json(
        {
            "rate": 1e6,
            "multi_turn": {
                "conversations": wl["conversations"],
                "turns": wl["turns"],
                "system_tokens": wl["system_len"],
                "user": wl["user_len"],
                "output": wl["output_len"],
                "turn_gap_s": 3.0,
                "concurrency": wl["concurrency"],
            },
        }
    )
    reqs = w.requests()
    assert len(reqs) == 16 * 4
    assert max(r.prompt_tokens for r in reqs) == 256 + 4 * 64 + 3 * 32
    starts = sorted(r.arrival_s for r in reqs if r.key and r.key.endswith("/t1"))
    assert max(starts[:8]) < 1e-4 and starts[8:] == pytest.approx(
        [12.0] * 8, abs=1e-4
    )  # 4 turns x 3 s, 8 at a time


# --- traces ---


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_csv_trace_sessions_and_shared_prefixes(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.csv",
        "arrival_s,prompt_tokens,output_tokens,prefix_id,prefix_tokens,tier\n"
        "12.5,400,40,chat,,1\n"
        "10.0,300,40,chat,,1\n"
        "11.0,2000,10,doc,1800,0\n"
        "\n"
        "13.0,50,5,,,\n"
        "14.0,500,8,chat,,1\n"
        "15.0,1900,3,doc,1800,2\n",
    )
    trace = load_workload(path)
    assert isinstance(trace, Trace)
    assert trace.requests() == [
        SimRequest(0.0, 300, 40, (), "chat/t1", 1, "trace"),
        SimRequest(1.0, 2000, 10, (("doc", 1800),), None, 0, "trace"),
        SimRequest(2.5, 400, 40, (("chat/t1", 340),), "chat/t2", 1, "trace"),
        SimRequest(3.0, 50, 5, (), None, 0, "trace"),
        SimRequest(4.0, 500, 8, (("chat/t2", 440),), "chat/t3", 1, "trace"),
        SimRequest(5.0, 1900, 3, (("doc", 1800),), None, 2, "trace"),
    ]
    assert trace.sessions == 1 and trace.request_rate() == 6 / 5
    assert trace.describe() == (
        "trace t.csv: 6 requests over 5 s, prompt 858 and output 18 tokens on average, 1 sessions"
    )
    # thinned by half: the conversation's three turns go or stay together
    half = trace.scaled(0.5)
    assert [r.prompt_tokens for r in half.requests()] == [300, 400, 50, 500]
    assert trace.scaled(0.5) == half


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("1.0,-3,4\n", "t.csv row 1: prompt_tokens must be a positive integer, got '-3'"),
        ("1.0,3,4\n2.0,3\n", "t.csv row 2: 2 fields, expected 3"),
        ("x,3,4\n", "t.csv row 1: arrival_s must be a number >= 0, got 'x'"),
        ("nan,3,4\n", "arrival_s must be a number >= 0"),
        ("1.0,3,0\n", "row 1: output_tokens must be a positive integer, got '0'"),
    ],
)
def test_csv_row_errors_name_the_row(tmp_path: Path, body: str, message: str) -> None:
    path = write(tmp_path / "t.csv", "arrival_s,prompt_tokens,output_tokens\n" + body)
    with pytest.raises(ValueError, match=message):
        load_workload(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "t.csv: the header must name arrival_s,prompt_tokens,output_tokens"),
        ("arrival_s,prompt_tokens\n1,2\n", "the header must name"),
        ("arrival_s,prompt_tokens,output_tokens,when\n", r"unknown or repeated columns \['when'\]"),
        ("arrival_s,prompt_tokens,output_tokens\n", "t.csv: no rows"),
        (
            "arrival_s,prompt_tokens,output_tokens,prefix_id\n0,100,50,a\n1,120,5,a\n",
            r"row 2: prompt_tokens 120 is shorter than 'a''s previous turn \(prompt \+ output = 1",
        ),
        (
            "arrival_s,prompt_tokens,output_tokens,prefix_id,prefix_tokens\n0,100,5,a,50\n"
            "1,100,5,a,60\n",
            "row 2: prefix_tokens 60 where earlier rows of 'a' have 50",
        ),
        (
            "arrival_s,prompt_tokens,output_tokens,prefix_tokens\n0,100,5,50\n",
            r"row 1: prefix_tokens 50 needs a prefix_id",
        ),
    ],
)
def test_csv_file_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_workload(write(tmp_path / "t.csv", text))


def bench_run(start: float) -> dict[str, object]:
    """A result as ``pdserve bench --save-detailed`` saves one: summary keys, then detail()."""
    outputs = [
        RequestOutput(True, start_time=start, prompt_tokens=100, output_tokens=20, kind="stream"),
        RequestOutput(
            True, start_time=start + 0.25, prompt_tokens=1024, output_tokens=16, kind="burst"
        ),
        RequestOutput(False, "HTTP 500", start_time=start + 0.5, prompt_tokens=50, kind="stream"),
        RequestOutput(True, start_time=start + 1.0, prompt_tokens=90, output_tokens=30, turn=2),
    ]
    return {"dataset": "mixed", "completed": 3, "failed": 1, **detail(outputs)}


def test_bench_detailed_result_is_a_trace(tmp_path: Path) -> None:
    path = write(tmp_path / "run.json", json.dumps(bench_run(0.125)))
    trace = load_workload(path)
    assert isinstance(trace, Trace)
    assert trace.requests() == [
        SimRequest(0.0, 100, 20, kind="stream"),
        SimRequest(0.25, 1024, 16, kind="burst"),
        SimRequest(1.0, 90, 30, kind="trace"),
    ]
    assert trace.skipped == 1 and "1 failed requests left out" in trace.describe()
    sweep = {"command": "pdserve bench ...", "rows": [bench_run(0.0), bench_run(3.0)]}
    path = write(tmp_path / "sweep.json", json.dumps(sweep))
    assert load_workload(path + "#1").requests() == trace.requests()
    with pytest.raises(ValueError, match=r"a sweep of 2 runs: pick one, .*sweep.json#N"):
        load_workload(path)
    with pytest.raises(ValueError, match=r"no run '2' \(0 to 1\)"):
        load_workload(path + "#2")
    undetailed = write(tmp_path / "plain.json", json.dumps({"rows": [{"completed": 3}]}))
    with pytest.raises(ValueError, match=r"input_lens must be a list .*--save-detailed"):
        load_workload(undetailed)
    short = {**bench_run(0.0), "kinds": ["stream"]}
    with pytest.raises(ValueError, match="the per-request lists differ in length"):
        load_workload(write(tmp_path / "short.json", json.dumps(short)))


def test_json_spec_file(tmp_path: Path) -> None:
    text = {"rate": 4, "requests": 10, "prompt": {"dist": "fixed", "value": 8}, "output": 2}
    w = load_workload(write(tmp_path / "w.json", json.dumps(text)))
    assert w == spec(duration_s=None, requests=10, rate=4, prompt=8, output=2)
    with pytest.raises(ValueError, match="not JSON"):
        load_workload(write(tmp_path / "bad.json", "{rate"))
    with pytest.raises(ValueError, match="workload: no such file"):
        load_workload(str(tmp_path / "none.json"))


# --- bad specs name their field ---


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rate=0,duration=5,prompt=1,output=1", "workload.rate: must be > 0, got 0"),
        ("rate=2e6,duration=5,prompt=1,output=1", r"workload.rate: must be <= 1e\+06"),
        ("rate=5,duration=-1,prompt=1,output=1", "workload.duration_s: must be > 0, got -1"),
        ("rate=5,duration=5,prompt=-3,output=1", "workload.prompt.value: must be >= 1, got -3"),
        (
            "rate=5,duration=5,prompt=1,output=lognormal:-3:1:9",
            "workload.output.mean: must be >= 1",
        ),
        ("rate=5,duration=5,prompt=uniform:9:3,output=1", "workload.prompt.high: must be >= 9"),
        (
            "rate=5,duration=5,prompt=lognormal:500:1:100,output=1",
            "workload.prompt.max: must be >= 500",
        ),
        ("rate=5,duration=5,prompt=20000000,output=1", r"workload.prompt.value: must be <= 1e\+07"),
        (
            "rate=5,duration=5,prompt=gauss:3:1,output=1",
            "workload.prompt: unknown distribution 'gauss'",
        ),
        ("rate=5,duration=5,prompt=uniform:3,output=1", "expected uniform:LOW:HIGH"),
        (
            "rate=5,duration=5,prompt=x,output=1",
            "workload.prompt.value: must be an integer, got 'x'",
        ),
        ("rate=5,duration=5,prompt=1", "workload.output: required"),
        ("rate=5,prompt=1,output=1", "workload.duration_s: give either duration_s or requests"),
        ("rate=5,duration=5,prompt=1,output=1,burstiness=0", "workload.burstiness: must be > 0"),
        ("rate=5,duration=5,prompt=1,output=1,seed=1.5", "workload.seed: must be an integer"),
        ("rate=5,durations=5,prompt=1,output=1", "workload.durations: unknown key"),
        ("rate=5,rate=5,duration=5,prompt=1,output=1", "workload.rate: given twice"),
        ("rate=5;duration=5", "workload.rate: must be a finite number, got '5;duration=5'"),
        ("rate", "workload: 'rate' is not key=value"),
        ("rate=1e6,duration=1e5,prompt=1,output=1", "workload: about 1e.11 requests: more than"),
    ],
)
def test_bad_compact_strings(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_compact(text)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": {"dist": "fixed", "valu": 3}}, "workload.prompt.valu: unknown field"),
        ({"prompt": {"dist": "zipf"}}, "workload.prompt.dist: must be one of fixed, uniform"),
        ({"prompt": [3]}, "workload.prompt: must be an object, an integer or a string"),
        (
            {"bursts": [{"every_s": 0, "size": 1, "prompt": 1, "output": 1}]},
            r"workload.bursts\[0\].every_s: must be > 0, got 0",
        ),
        (
            {"bursts": [{"every_s": 1, "size": 1, "prompt": 1, "output": -3}]},
            r"workload.bursts\[0\].output.value: must be >= 1, got -3",
        ),
        (
            {"bursts": [{"every_s": 1, "size": 1, "prompt": 1}]},
            r"workload.bursts\[0\].output: required",
        ),
        ({"bursts": {"every_s": 1}}, "workload.bursts: must be a list"),
        (
            {"bursts": [{"every_s": 1e-6, "size": 100, "prompt": 1, "output": 1}]},
            "workload: about 5e.08 requests",
        ),
        (
            {"tiers": [{"tier": 0, "share": 0.5}, {"tier": 1, "share": 0.4}]},
            "workload.tiers: shares must sum to 1, got 0.9",
        ),
        ({"tiers": [{"tier": -1, "share": 1}]}, r"workload.tiers\[0\].tier: must be >= 0"),
        ({"tiers": [{"tier": 0, "share": 0.5}, {"tier": 0, "share": 0.5}]}, "listed twice"),
        (
            {"shared_prefix": {"groups": 0, "tokens": 5}},
            "workload.shared_prefix.groups: must be >= 1",
        ),
        ({"multi_turn": MULTI}, "workload.prompt: not with multi_turn"),
        ({"unknown": 1}, "workload.unknown: unknown field"),
        ({"rate": "fast"}, "workload.rate: must be a finite number, got 'fast'"),
        ({"rate": float("inf")}, "workload.rate: must be a finite number"),
        ({"duration_s": True}, "workload.duration_s: must be a finite number, got True"),
    ],
)
def test_bad_json_specs(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**fields)


@pytest.mark.parametrize(
    ("multi", "message"),
    [
        ({"turns": 0}, "workload.multi_turn.turns: must be >= 1, got 0"),
        ({"user": "uniform:0:3"}, "workload.multi_turn.user.low: must be >= 1, got 0"),
        ({"turn_gap_s": -1}, "workload.multi_turn.turn_gap_s: must be >= 0, got -1"),
        ({"shared_system": "yes"}, "workload.multi_turn.shared_system: must be true or false"),
        ({"concurrency": 0}, "workload.multi_turn.concurrency: must be >= 1"),
        ({"turns": 1000, "user": 20000}, "workload.multi_turn.turns: the last turn's prompt may"),
        ({"think": 1}, "workload.multi_turn.think: unknown field"),
        ({"conversations": 3_000_000}, "workload: about 9e.06 requests"),
    ],
)
def test_bad_multi_turn(multi: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_from_json({"rate": 1, "multi_turn": {**MULTI, **multi}})


# --- slices and the planner's figures ---


def test_scaled_thins_the_stream_and_rounds_bursts() -> None:
    burst = {"every_s": 5, "size": 40, "prompt": 1024, "output": 16}
    w = spec(rate=5000, duration_s=20, prompt=3000, output=400, bursts=[burst])
    tenth = w.scaled(0.1)
    assert (tenth.rate, tenth.duration_s, tenth.bursts[0].size) == (500, 20, 4)
    assert w.scaled(0.26).bursts[0].size == 10  # 10.4 rounds to 10
    with pytest.raises(ValueError, match=r"bursts\[0\].size: 40 × 0.01 = 0.4 requests"):
        w.scaled(0.01)
    with pytest.raises(ValueError, match=r"bursts\[0\].size: 40 × 0.0375 = 1.5 requests"):
        w.scaled(0.0375)  # 2 is a third off
    with pytest.raises(ValueError, match="fraction: must be <= 1"):
        w.scaled(2)
    counted = spec(duration_s=None, requests=999).scaled(0.5)
    assert counted.num_requests == 500 and counted.horizon_s() == 100
    multi = spec_from_json(
        {"rate": 8, "multi_turn": {**MULTI, "conversations": 40, "concurrency": 6}}
    ).scaled(0.25)
    assert multi.multi_turn is not None
    assert (multi.rate, multi.multi_turn.conversations, multi.multi_turn.concurrency) == (2, 10, 2)


def test_means_and_rate_for_the_planner() -> None:
    burst = {"every_s": 5, "size": 10, "prompt": 1000, "output": 10}
    w = spec(rate=8, duration_s=20, prompt="uniform:100:300", output=50, bursts=[burst])
    # the bursts sent: at 5, 10 and 15 s (20 is the end), 30 requests over 20 s
    assert w.request_rate() == 8 + 30 / 20
    assert w.mean_prompt_tokens() == (8 * 200 + 1.5 * 1000) / 9.5
    assert w.mean_output_tokens() == (8 * 50 + 1.5 * 10) / 9.5
    reqs = w.requests()
    assert len([r for r in reqs if r.kind == "burst"]) == 30
    assert w.describe() == (
        "8 req/s for 20 s, prompt uniform:100:300, output 50; bursts of 10 every 5 s "
        "(prompt 1000, output 10); seed 0"
    )
    multi = spec_from_json(
        {"rate": 2, "burstiness": 0.5, "multi_turn": {**MULTI, "concurrency": 4}}
    )
    assert multi.describe() == (
        "2 conversations × 3 turns at 2/s, 4 at a time (shared system 10, user 5, output 7, "
        "turn gap 1 s, think 0.5 s), burstiness 0.5; seed 0"
    )
