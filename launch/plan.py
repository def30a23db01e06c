"""``pdserve plan``: which layout serves a workload within its SLOs on the fewest devices,
found by simulating the cluster (sim/search.py) on a measured profile (``--profile``, one file
per TP size) or on one derived for hardware not measured here (``--device`` and ``--shape``:
sim/derive.py's roofline; such a profile is marked derived wherever it is shown)::

    pdserve plan --model llama-3-70b --device h100 --shape llama-3-70b \\
        --workload rate=5000,duration=20,prompt=3000,output=400 \\
        --ttft-slo 0.7 --tpot-slo 0.04 --price-per-device-hour 2.5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pdserve.coordinator.profile import Profile
from pdserve.sim.config import MODES, Link, SimConfig
from pdserve.sim.results import Slo
from pdserve.sim.search import Answer, Question, plan
from pdserve.sim.workload import load_workload

DEFAULT_TPS = (1, 2, 4, 8)
CPU_LINK = 1e9  # bytes/s: KV between workers on one host (a measured profile's default)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the model's name (shown; a catalog shape)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--profile", action="append", help="a measured profile (pdserve profile); one per TP size"
    )
    src.add_argument("--device", help="derive profiles for this device (h100, h200, a100, ...)")
    p.add_argument("--shape", help="the model's shape: a catalog name, a spec, or a config.json")
    p.add_argument("--workload", required=True, help="rate=...,prompt=...,output=... or a file")
    p.add_argument("--ttft-slo", required=True, help="p99 time to first token (s, or 700ms)")
    p.add_argument("--tpot-slo", required=True, help="p99 time per output token (s, or 40ms)")
    p.add_argument("--devices", type=int, default=None, help="at most this many devices")
    p.add_argument("--price-per-device-hour", type=float, default=None)
    p.add_argument("--tp", default=None, help="TP sizes to try with --device (1,2,4,8)")
    p.add_argument("--modes", default=",".join(MODES), help="colocated,disagg")
    p.add_argument("--max-num-seqs", type=int, default=None, help="64 (measured), 256 (derived)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--link-bandwidth", type=float, default=None, help="KV bytes/s per device")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def seconds(text: str, field: str) -> float:
    """``0.7`` or ``700ms`` in seconds; ``ValueError`` naming ``field`` unless > 0."""
    raw = text.strip().lower()
    try:
        value = float(raw[:-2]) / 1e3 if raw.endswith("ms") else float(raw.rstrip("s"))
    except ValueError:
        raise ValueError(f"{field}: {text[:40]!r} is not a number of seconds") from None
    if not value > 0 or value > 1e5:
        raise ValueError(f"{field} must be > 0 seconds (and under a day), got {text[:40]!r}")
    return value


def build_question(args: argparse.Namespace) -> tuple[Question, list[str]]:
    """The question the flags ask, and the lines that say where its profiles came from."""
    from pdserve.sim.derive import derive_profile
    from pdserve.sim.devices import parse_device
    from pdserve.sim.shapes import SHAPES, parse_shape, shape, shape_from_config

    slo = Slo(seconds(args.ttft_slo, "--ttft-slo"), seconds(args.tpot_slo, "--tpot-slo"))
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes: {args.modes!r}: each of {', '.join(MODES)}")
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    if args.price_per_device_hour is not None and not args.price_per_device_hour > 0:
        raise ValueError(f"--price-per-device-hour must be > 0, got {args.price_per_device_hour}")
    workload = load_workload(args.workload)
    spec = args.shape or (args.model if args.model in SHAPES else None)
    model_shape = None
    if spec is not None:
        if spec in SHAPES:
            model_shape = shape(spec)
        elif "=" in spec:
            model_shape = parse_shape(spec)
        else:
            model_shape = shape_from_config(spec)
    lines: list[str] = []
    profiles: dict[int, Profile] = {}
    if args.device:
        if model_shape is None:
            raise ValueError("--shape: needed with --device (a catalog name, a spec or a file)")
        device = parse_device(args.device)
        tps = _tps(args.tp) if args.tp else DEFAULT_TPS
        for tp in tps:
            if tp > device.devices_per_node:
                continue
            try:
                profiles[tp] = derive_profile(model_shape, device, tp)
            except ValueError as e:
                lines.append(f"TP {tp}: {e}")
        if not profiles:
            raise ValueError(f"--device {args.device}: the model fits no TP size tried ({lines})")
        first = next(iter(profiles.values()))
        lines.insert(0, f"profiles DERIVED, not measured: {first.derived}")
        link = device.net_bw
    else:
        for path in args.profile:
            prof = Profile.load(path)
            if prof.tensor_parallel_size in profiles:
                raise ValueError(
                    f"--profile {path}: a second profile at TP {prof.tensor_parallel_size}"
                )
            profiles[prof.tensor_parallel_size] = prof
            kind = f"DERIVED ({prof.derived})" if prof.is_derived else "measured"
            lines.append(f"profile {path}: {kind}, TP {prof.tensor_parallel_size}")
        if model_shape is None:
            raise ValueError("--shape: needed to size KV transfers (a catalog name, spec or file)")
        link = CPU_LINK
    derived = any(p.is_derived for p in profiles.values())
    config = SimConfig(
        kv_bytes_per_token=max(1, round(model_shape.kv_bytes_per_token())),
        max_num_seqs=args.max_num_seqs or (256 if derived else 64),
        max_num_batched_tokens=args.max_num_batched_tokens,
        link=Link(bandwidth=args.link_bandwidth or link, latency_s=1e-4 if derived else 1e-3),
        hop_s=2e-4 if derived else 5e-4,
    )
    question = Question(
        workload=workload,
        slo=slo,
        profiles=profiles,
        config=config,
        modes=modes,
        max_devices=args.devices,
        price_per_device_hour=args.price_per_device_hour,
        seed=args.seed,
    )
    return question, lines


def _tps(text: str) -> tuple[int, ...]:
    try:
        tps = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise ValueError(f"--tp: {text[:40]!r} is not a list of integers") from None
    if not tps or tps[0] < 1 or tps[-1] > 64:
        raise ValueError(f"--tp: sizes between 1 and 64, got {text[:40]!r}")
    return tps


def render(answer: Answer, lines: list[str], q: Question, top: int, wall_s: float) -> str:
    out = [
        *lines,
        f"workload: {q.workload.describe()}",
        f"SLO: TTFT p99 <= {q.slo.ttft_s * 1e3:g} ms, TPOT p99 <= {q.slo.tpot_s * 1e3:g} ms",
        "",
    ]
    if not answer.best:
        out.append("no layout searched meets the SLOs")
    header = (
        "layout",
        "devices",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
        "goodput/device",
        "$/M out tok",
        "binding",
    )
    rows = [header]
    for v in answer.best[:top]:
        f = v.figures
        cost = v.cost_per_million_tokens
        rows.append(
            (
                v.layout.describe()
                + (f" (target {v.tpot_target_s * 1e3:.0f} ms)" if v.tpot_target_s else ""),
                str(v.layout.devices),
                f"{f['p50_ttft_ms']:.0f} / {f['p99_ttft_ms']:.0f}",
                f"{f.get('p50_tpot_ms', 0):.1f} / {f.get('p99_tpot_ms', 0):.1f}",
                f"{v.goodput_per_device:.3g} req/s",
                "-" if cost is None else f"{cost:.3g}",
                v.binding,
            )
        )
    if answer.best:
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    scales = sorted({v.scale for v in answer.best})
    if any(s > 1 for s in scales):
        out.append(
            f"simulated as slices of 1/{', 1/'.join(map(str, scales))} of the cluster "
            "(worker counts in multiples of that)"
        )
    out += answer.notes
    out.append(f"{answer.tried} layouts simulated in {wall_s:.1f} s")
    return "\n".join(out)


def run_plan(args: argparse.Namespace) -> int:
    try:
        question, lines = build_question(args)
        started = time.perf_counter()
        answer = plan(question)
    except (ValueError, RuntimeError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    wall = time.perf_counter() - started
    if args.json:
        doc: dict[str, Any] = {
            "profiles": lines,
            "derived": any(p.is_derived for p in question.profiles.values()),
            "workload": question.workload.describe(),
            "slo_ms": {
                "ttft_p99": question.slo.ttft_s * 1e3,
                "tpot_p99": question.slo.tpot_s * 1e3,
            },
            "layouts": [v.to_json() for v in answer.best[: args.top]],
            "notes": answer.notes,
            "simulated": answer.tried,
            "seconds": wall,
        }
        print(json.dumps(doc, indent=1))
    else:
        print(render(answer, lines, question, args.top, wall))
    return 0
