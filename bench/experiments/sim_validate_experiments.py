"""Each committed experiment set beside its replay (sim_replays.py): the host-speed scales
from the run's own step counters, every figure real and simulated (calibrated and not), the
comparisons the real run made, and the notes and variants the report explains the misses with."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any  # the committed results are JSON

from pdserve.bench.experiments import sim_replays as r
from pdserve.bench.experiments.sim_validate_records import Json, Report
from pdserve.coordinator.profile import Profile
from pdserve.sim.calibrate import decode_scale, prefill_scale, scale_profile
from pdserve.sim.results import Slo

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench/results"
MODEL = "smollm2-135m-instruct"


def read_json(name: str) -> Json:
    data: Json = json.loads((RESULTS / name).read_text())
    return data


def scales_of(workers: list[dict[str, float]], profile: Profile, context: int) -> Json:
    decode = decode_scale(workers, profile, context)
    return {"prefill": prefill_scale(workers, profile, decode, context), "decode": decode}


# ---- disagg_vs_colocated ----------------------------------------------------------------------
DVC_FIGURES = {  # report name -> the bench's key
    "ttft_p50_ms": "median_ttft_ms",
    "ttft_p90_ms": "p90_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_p50_ms": "median_tpot_ms",
    "tpot_p90_ms": "p90_tpot_ms",
    "tpot_p99_ms": "p99_tpot_ms",
    "itl_p99_ms": "p99_itl_ms",
    "goodput_rps": "request_goodput",
}
DVC_COMPARISONS = (  # (figure, better, arms): what the README's table and text compare
    ("goodput_rps", "higher", ("colocated", "disagg")),
    ("goodput_rps", "higher", ("colocated", "conditional")),
    ("goodput_rps", "higher", ("colocated", "colocated-stall")),
    ("goodput_rps", "higher", tuple(r.DVC_ARMS)),
    ("tpot_p99_ms", "lower", ("colocated", "disagg")),
    ("tpot_p99_ms", "lower", ("colocated", "colocated-stall")),
    ("itl_p99_ms", "lower", ("colocated", "colocated-stall")),
    ("ttft_p50_ms", "lower", ("colocated", "colocated-stall")),
    ("ttft_p99_ms", "lower", ("colocated", "colocated-stall")),
)
DVC_CONTEXT = 64  # streams of 32 -> 64 tokens: a mean context of ~64 (the profile's 128 row)


def disagg_vs_colocated(rep: Report, profile: Profile, planner: Profile, rates: int) -> None:
    exp = "disagg_vs_colocated"
    data = read_json(f"disagg_vs_colocated_{MODEL}.json")
    w = data["workload"]
    workers = [c for rounds in data["steps"].values() for run in rounds for c in run.values()]
    scales = scales_of(workers, profile, DVC_CONTEXT)
    per_arm = {
        arm: scales_of([c for run in rounds for c in run.values()], profile, DVC_CONTEXT)
        for arm, rounds in data["steps"].items()
    }
    calibrated = scale_profile(profile, scales["prefill"], scales["decode"])
    rows = data["rows"][:rates]
    speeds = [row["rate"] for row in rows]
    warmup = w_warmup(data)
    runs = {arm: r.dvc_run(arm, w, speeds, warmup, calibrated, planner) for arm in r.DVC_ARMS}
    raws = {arm: r.dvc_run(arm, w, speeds, warmup, profile, planner)[0] for arm in r.DVC_ARMS}
    plain = r.dvc_run("disagg", w, speeds, warmup, calibrated, None)[0]
    counts = {}
    for i, row in enumerate(rows):
        case = f"{row['rate']:g}/s"
        sim = {arm: runs[arm][0][i] for arm in r.DVC_ARMS}
        for arm in r.DVC_ARMS:
            for name, key in DVC_FIGURES.items():
                rounds = [x[key] for x in row[arm]["rounds"]]
                raw = raws[arm][i][name]
                rep.figure(exp, f"{case} {arm}", name, row[arm][key], rounds, sim[arm][name], raw)
        sent = r.mixed_workload(w, row["rate"], i)
        counts[case] = {
            "sent": len(sent),
            "streams": sum(q.kind == "stream" for q in sent),
            "real": row["disagg"]["rounds"][0]["num_prompts"],
        }
        for name, better, arms in DVC_COMPARISONS:
            real = {a: row[a][DVC_FIGURES[name]] for a in arms}
            by_round = {a: [x[DVC_FIGURES[name]] for x in row[a]["rounds"]] for a in arms}
            rep.compare(exp, case, name, better, real, by_round, {a: sim[a][name] for a in arms})
    disagg_run, auto = runs["disagg"][1], runs["disagg"][2]
    real_local = [
        sum(c.get(f"{k}:prefill_tokens_sum", 0.0) for k in ("prefill", "mixed"))
        / w["stream_input_len"]
        for run in data["steps"]["disagg"]
        for name, c in run.items()
        if name.startswith("decode")
    ]
    rep.experiments[exp] = {
        "over_target": over_target(data["steps"]),
        "source": f"bench/results/disagg_vs_colocated_{MODEL}.json",
        "run": "2026-11-25 18:10-18:24, GGUF weights, 2 rounds (figures: medians)",
        "scales": scales | {"from": "own step counters (every arm, round and worker)"},
        "scales_per_arm": per_arm,
        "requests_sent": counts,
        "notes": [
            "arms: disagg 1P+1D with the flag's default --max-local-prefill-tokens auto (the "
            "planner's threshold, emulated: sim_replays.AutoThreshold); conditional 1P+1D at "
            "128; colocated 2 workers at --tpot-target-ms 150; colocated-stall at 0",
            "one run an arm, as one server ran: the warm-up's 4 streams at once, then each "
            "rate once the one before is back (the planner's window spans them)",
        ],
    }
    streams = [o for o in disagg_run.outcomes if o.req.kind == "stream"]
    rep.variants["dvc_local_streams"] = {
        "sim": sum(o.local for o in streams),
        "sim_bursts": sum(o.local for o in disagg_run.outcomes if o.req.kind == "burst"),
        "sim_threshold": auto.seen if auto else [],
        "real_by_round": real_local,
        "streams_a_round": len(streams),
    }
    cases = [f"{x:g}/s" for x in speeds]
    rep.variants["dvc_disagg_threshold_0"] = dict(zip(cases, plain, strict=True))
    rep.variants["dvc_worker_totals"] = {
        "sim": {arm: run[1].workers for arm, run in runs.items()},
        "real_by_round": {
            arm: [{name: totals(c) for name, c in run.items()} for run in rounds]
            for arm, rounds in data["steps"].items()
        },
    }


def w_warmup(data: Json) -> int:
    """The warm-up's requests (streams, once a server: ``--warmup``), from the bench command."""
    flag = next(a for a in data["bench_command"].split() if a.startswith("--warmup="))
    return int(flag.split("=", 1)[1])


def over_target(steps: dict[str, list[dict[str, dict[str, float]]]]) -> Json:
    """Per arm, summed over its rounds and workers: mixed steps, and those the engine counted
    over its TPOT target by reason (misprediction, decodes, age_bound)."""
    out: Json = {}
    for arm, rounds in steps.items():
        cs = [c for run in rounds for c in run.values()]
        out[arm] = {"mixed_steps": sum(c.get("mixed:seconds_count", 0.0) for c in cs)}
        for reason in ("misprediction", "decodes", "age_bound"):
            out[arm][reason] = sum(c.get(f"over_target:{reason}", 0.0) for c in cs)
    return out


def totals(c: dict[str, float]) -> dict[str, float]:
    """A real worker's counters as the simulator's totals (every kind of step)."""
    kinds = ("decode", "mixed", "prefill")
    return {
        "steps": sum(c.get(f"{k}:seconds_count", 0.0) for k in kinds),
        "seconds": sum(c.get(f"{k}:seconds_sum", 0.0) for k in kinds),
        "mixed": c.get("mixed:seconds_count", 0.0),
        "mixed_seconds": c.get("mixed:seconds_sum", 0.0),
        "prompt_tokens": sum(c.get(f"{k}:prefill_tokens_sum", 0.0) for k in kinds),
        "decode_seqs": sum(c.get(f"{k}:decode_seqs_sum", 0.0) for k in kinds),
    }


# ---- stall_gap --------------------------------------------------------------------------------
STALL_ARMS = {"stall-free": None, "stall": 0.0}  # None: the run's --tpot-target-ms


def stall_gap(rep: Report, profile: Profile) -> None:
    exp = "stall_gap"
    data = read_json("stall_gap.json")
    args = data["args"]
    workers = [x["steps"]["decode-0"] for rounds in data["rounds"].values() for x in rounds]
    scales = scales_of(workers, profile, 96)
    per_arm = {
        arm: scales_of([x["steps"]["decode-0"] for x in rounds], profile, 96)
        for arm, rounds in data["rounds"].items()
    }
    calibrated = scale_profile(profile, scales["prefill"], scales["decode"])
    sim, real = {}, {}
    real_rounds: dict[str, dict[str, list[float]]] = {}
    for arm, target in STALL_ARMS.items():
        target_s = args["tpot_target_ms"] / 1e3 if target is None else target
        sim[arm] = r.stall_gap_run(args, target_s, calibrated)
        raw = r.stall_gap_run(args, target_s, profile)
        real[arm], real_rounds[arm] = r.stall_gap_real(data["rounds"][arm])
        for name, value in sim[arm].items():
            rep.figure(exp, arm, name, real[arm][name], real_rounds[arm][name], value, raw[name])
    for name in sim["stall"]:
        rep.compare(
            exp,
            "stall-free vs old",
            name,
            "lower",
            {a: real[a][name] for a in STALL_ARMS},
            {a: real_rounds[a][name] for a in STALL_ARMS},
            {a: sim[a][name] for a in STALL_ARMS},
        )
    rep.experiments[exp] = {
        "over_target": over_target(
            {a: [x["steps"] for x in rounds] for a, rounds in data["rounds"].items()}
        ),
        "source": "bench/results/stall_gap.json",
        "run": "2026-11-28, GGUF weights, one colocated worker with both cores (2 threads), "
        "3 rounds (figures: medians; prompts' TTFT: the first and the second to finish)",
        "scales": scales
        | {
            "from": "own step counters (both arms, every round): a 2-thread worker against "
            "the 1-thread profile"
        },
        "scales_per_arm": per_arm,
        "notes": [
            "the prompts go once every stream has 8 tokens (+ half the client's 50 ms poll); "
            "gaps counted while the prompts wait, as the script counts them"
        ],
    }


# ---- kv_routing -------------------------------------------------------------------------------
KV_FIGURES = ("ttft_p50_ms", "tpot_p50_ms", "cached_fraction", "prefill_tokens")
KV_BETTER = {"cached_fraction": "higher"}


# the float32 runs (kv_routing 2026-11-23, the autoscale trace 2026-11-25): no step counters of
# their own to scale by; the float32 profile of 2026-11-25 (models/profiles), the weights they
# served, as it was measured
FP32_SCALES = {
    "prefill": 1.0,
    "decode": 1.0,
    "from": "none: the float32 profile measured 2026-11-25 (models/profiles/), as is",
}


def kv_routing(rep: Report, profile: Profile, nearest: Json, fp32: Profile) -> None:
    exp = "kv_routing"
    data = read_json(f"kv_routing_{MODEL}.json")
    w = data["workload"]
    # the run served float32 weights: the float32 profile (measured 2026-11-25, shipped), as is;
    # today's GGUF profile scaled by 2026-11-25's factors is a variant
    gguf_scaled = scale_profile(profile, nearest["prefill"], nearest["decode"])
    local = w["max_local_prefill_tokens"]
    # --routing load: the coordinator counts no decode hit (decode_hit_tokens), so no turn
    # (333 tokens and more) is short enough to prefill locally: the rule gives 0 here
    arms = {"kv": local, "load": local}  # the run's flags: both arms at the same threshold
    runs = {a: [x for x in data["runs"] if x["arm"] == a] for a in arms}
    real = {a: {n: statistics.median(x[n] for x in runs[a]) for n in KV_FIGURES} for a in arms}
    sim = {a: r.kv_routing_run(w, a, fp32, n) for a, n in arms.items()}
    raw = {a: r.kv_routing_run(w, a, profile, n) for a, n in arms.items()}
    for a in arms:
        for name in KV_FIGURES:
            rounds = [x[name] for x in sorted(runs[a], key=lambda x: x["seed"])]
            rep.figure(exp, a, name, real[a][name], rounds, sim[a][name], raw[a][name])
    for name in KV_FIGURES:
        by_seed = {a: [x[name] for x in sorted(runs[a], key=lambda x: x["seed"])] for a in arms}
        better = KV_BETTER.get(name, "lower")
        rep.compare(
            exp,
            "kv vs load",
            name,
            better,
            {a: real[a][name] for a in arms},
            by_seed,
            {a: sim[a][name] for a in arms},
        )
    rep.experiments[exp] = {
        "source": f"bench/results/kv_routing_{MODEL}.json",
        "run": "2026-11-23 13:05, float32 weights (before GGUF was served), 2P+2D on 2 cores "
        "(a prefill and a decode worker sharing each core), no TPOT target yet, 3 rounds",
        "scales": FP32_SCALES,
        "prompt_tokens_turns_3plus": {
            "real_by_run": [x["prompt_tokens"] for x in data["runs"]],
            "sim": sim["kv"]["turns3_prompt_tokens"],
        },
        "notes": [
            "a closed loop: 4 warm-up first turns, then 16 conversations x 4 turns, 8 at a time",
            "prompts: ChatML frames (5 tokens a message, 3 for the reply's header) around the "
            "system 256, user 64 and answers of 32 tokens",
            "both arms at the run's --max-local-prefill-tokens; under --routing load the rule "
            "reads no decode cache hit (as Placement.decode_hit_tokens), so turns 2+ go to the "
            "prefill pool",
            "cached_fraction (sim): 1 - computed / prompt tokens of turns 3+ (the computing "
            "worker's hit; the real one is the larger of the prefill and decode workers' hits)",
            "prefill_tokens: prompt tokens computed over every turn and the warm-up",
        ],
    }
    rep.variants["kv_gguf_profile_scaled_as_2026_11_25"] = {
        a: r.kv_routing_run(w, a, gguf_scaled, n) for a, n in arms.items()
    }
    # how much the closed loop's outcome moves with the prefill scale 1% either way
    rep.variants["kv_prefill_scale_sensitivity"] = {
        f"x{f:g}": {
            a: r.kv_routing_run(w, a, scale_profile(fp32, f, 1.0), n) for a, n in arms.items()
        }
        for f in (0.99, 1.0, 1.01)
    }


# ---- autoscale_trace --------------------------------------------------------------------------
AUTOSCALE_FIGURES = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "tpot_p99_ms",
    "attainment",
)


def autoscale_trace(
    rep: Report, profile: Profile, nearest: Json, fp32: Profile, model_dir: str | None
) -> None:
    exp = "autoscale_trace"
    data = read_json("autoscale_trace.json")
    t = data["trace"]
    slo = Slo(ttft_s=t["slo_ttft"], tpot_s=t["slo_tpot"])
    rep.experiments[exp] = {
        "source": "bench/results/autoscale_trace.json",
        "run": "2026-11-25 12:42, float32 weights (before GGUF was served), before the TPOT "
        "target existed; 3 rounds (figures: each round's from its per-request rows, medians)",
        "scales": FP32_SCALES,
        "notes": [
            "fixed arm: 1P+1D, one thread each, 1,024 KV blocks a worker; its local-prefill "
            "threshold as the poller recorded it each second (the planner set it: auto)",
            "autoscale arm not replayed: its extra prefill workers (1 -> 3 at 111-120 s) were "
            "pinned onto the two busy cores (slot i on core i mod 2), time-sharing them; the "
            "simulator gives every worker a device of its own and cannot add one mid-run "
            "(sim/cluster.py has a fixed layout)",
        ],
    }
    real_rows = r.autoscale_real(data["rounds"]["fixed"], slo)
    rep.experiments[exp]["real_low_phase_tpot_p50_ms_by_round"] = [
        statistics.median(p[4] * 1e3 for p in x["per_request"] if p[2] == "low" and p[4])
        for x in data["rounds"]["fixed"]
    ]
    real = r.medians(real_rows)
    for name, better in (("attainment", "higher"), ("tpot_p99_ms", "lower")):
        key = {"attainment": "attain_both", "tpot_p99_ms": "p99_tpot_ms"}[name]
        arms = {a: data["results"][a][key] for a in ("fixed", "autoscale")}
        rounds = {a: [x[key] for x in data["rounds"][a]] for a in arms}
        rep.compare(exp, "fixed vs autoscale", name, better, arms, rounds, None)
    traces = build_traces(data, model_dir)
    if traces is None:
        rep.experiments[exp]["notes"].append("fixed arm left out: no tokenizer to rebuild it")
        return
    rounds = data["rounds"]["fixed"]
    gguf_scaled = scale_profile(profile, nearest["prefill"], nearest["decode"])

    def over_rounds(p: Profile) -> dict[str, float]:
        pairs = zip(traces, rounds, strict=True)
        return r.medians([r.autoscale_fixed_run(tr, x["samples"], p, slo) for tr, x in pairs])

    sim, raw = over_rounds(fp32), over_rounds(profile)
    for name in AUTOSCALE_FIGURES:
        real_round = [x[name] for x in real_rows]
        rep.figure(exp, "fixed", name, real[name], real_round, sim[name], raw[name])
    rep.experiments[exp]["trace_check"] = {
        "requests_by_round": [len(tr) for tr in traces],
        "real_by_round": [len(x["per_request"]) for x in rounds],
        "max_send_time_difference_s": max(
            abs((q.at or 0.0) - p[0])
            for tr, x in zip(traces, rounds, strict=True)
            for q, p in zip(tr, x["per_request"], strict=True)
        ),
    }
    rep.variants["autoscale_fixed_gguf_profile_scaled_as_2026_11_25"] = over_rounds(gguf_scaled)


def build_traces(data: Json, model_dir: str | None) -> list[list[Any]] | None:
    """Each round's trace as autoscale_trace.py built it (its seed; the tokenizer's prompts
    draw from the same generator as the lengths); None without the tokenizer."""
    from pdserve.bench.experiments.autoscale_trace import build_trace
    from pdserve.bench.prompts import TokenPrompts, load_tokenizer
    from pdserve.models.store import resolve_model

    try:
        path = model_dir or resolve_model(MODEL, pull=False)
        maker = TokenPrompts(load_tokenizer(path))
    except (FileNotFoundError, ValueError):
        return None
    args = argparse.Namespace(**data["trace"])
    return [build_trace(args, maker, args.seed + i) for i in range(len(data["rounds"]["fixed"]))]
