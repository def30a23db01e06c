"""The simulator against the real runs committed under bench/results/ (issue 40, item 3).

Replays every experiment (bench/experiments/sim_replays.py: each workload as the real run sent
it, each arm as the script started it) on this machine's profile
(``bench/results/sim_profile_smollm2-135m-instruct.json``), brought to each run's host speed
by two scalars read off that run's own step counters (sim/calibrate.py), and sets every figure
beside the real one: the error, whether it is within the aim (p50-class figures 15%, tails and
goodput 25%), and whether the simulator picks the winner of each comparison the real runs made.

    .venv/bin/python bench/experiments/sim_validate.py          # a few seconds

Writes ``bench/results/sim_validation.{json,md,png}`` (sim_validate_report.py). The autoscale
trace's fixed arm needs SmolLM2's tokenizer (``pdserve pull smollm2-135m-instruct``): its
trace's lengths come from the prompt generator's draws; without it that arm is left out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pdserve.bench.experiments import sim_replays as r
from pdserve.bench.experiments.sim_validate_experiments import (
    MODEL,
    RESULTS,
    ROOT,
    autoscale_trace,
    disagg_vs_colocated,
    kv_routing,
    stall_gap,
)
from pdserve.bench.experiments.sim_validate_records import AIM_P50, AIM_TAIL, Json, Report
from pdserve.coordinator.profile import Profile, shipped_profile

PROFILE = RESULTS / f"sim_profile_{MODEL}.json"


def validate(rates: int = 3, model_dir: str | None = None, with_trace: bool = True) -> Json:
    """Every replay; ``rates``: how many of disagg_vs_colocated's rates (a quicker check)."""
    profile = Profile.load(PROFILE)
    shipped = shipped_profile(MODEL)
    if shipped is None:
        raise SystemExit(f"no shipped profile of {MODEL} (the planner's)")
    rep = Report()
    disagg_vs_colocated(rep, profile, shipped, rates)
    stall_gap(rep, profile)
    nearest = {
        k: rep.experiments["disagg_vs_colocated"]["scales"][k] for k in ("prefill", "decode")
    }
    kv_routing(rep, profile, nearest, shipped)
    if with_trace:
        autoscale_trace(rep, profile, nearest, shipped, model_dir)
    header = {
        "command": ".venv/bin/python bench/experiments/sim_validate.py",
        "profile": {
            "file": str(PROFILE.relative_to(ROOT)),
            "measured": "2026-11-29, pdserve profile --model smollm2-135m-instruct --threads 1 "
            "(GGUF Q4_1+Q8_0 kept quantized, as make serve serves it)",
            "lone_decode_ms": 1e3 * profile.decode_step_seconds(1, 0),
        },
        "link": {
            "bandwidth_mb_s": r.LINK.bandwidth / 1e6,
            "latency_s": r.LINK.latency_s,
            "source": "zmq + CURVE (serve's default --transfer-backend): "
            "bench/results/transfer_ttft.json, 2,048 tokens' KV in 0.714 s",
        },
        "kv_bytes_per_token": r.KV_BYTES_PER_TOKEN,
        "hop_s": r.HOP_S,
        "aims": {"p50_class": AIM_P50, "tail_class": AIM_TAIL},
    }
    return header | rep.to_json()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(RESULTS / "sim_validation.json"))
    p.add_argument("--model-dir", default=None, help="SmolLM2's directory (its tokenizer)")
    args = p.parse_args(argv)
    from pdserve.bench.experiments.sim_validate_report import write

    started = time.perf_counter()
    report = validate(model_dir=args.model_dir)
    write(report, Path(args.out))
    s = report["summary"]
    print(
        f"{s['within']} of {s['figures']} figures within the aim ({s['within_uncalibrated']} "
        f"uncalibrated); same winner in {s['same_winner']} of {s['comparisons']} comparisons; "
        f"{time.perf_counter() - started:.1f} s; wrote {Path(args.out).with_suffix('.md')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
