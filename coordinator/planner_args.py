"""The planner's flags (the coordinator's; ``pdserve serve`` passes them on) and the planner
each served model gets from them: its SLOs, and its profiles, one a tensor-parallel size
(``--profile``; at size 1 the one shipped for the model where none is given; at a size with
none the planner goes by live signals alone for the pool whose workers run at it)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from pdserve.coordinator.planner import Planner, PlannerConfig, Targets
from pdserve.coordinator.profile import Profile, shipped_profile

logger = logging.getLogger(__name__)


def add_planner_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--ttft-slo",
        type=float,
        default=Targets().ttft_s,
        help="planner: target p90 time to first token, seconds",
    )
    parser.add_argument(
        "--tpot-slo",
        type=float,
        default=Targets().tpot_s,
        help="planner: target p90 time per output token, seconds",
    )
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="FILE",
        help="planner: a model's profile from `pdserve profile` (repeatable: one per model and "
        "tensor-parallel size, each pool sized with the one at its workers' size; at size 1 "
        "the default is the one shipped for the model, if any)",
    )
    parser.add_argument(
        "--planner-interval", type=float, default=5.0, help="planner: seconds between plans"
    )
    parser.add_argument(
        "--planner-window",
        type=float,
        default=30.0,
        help="planner: seconds of arrivals and latency samples each plan reads",
    )
    parser.add_argument(
        "--scale-up-cooldown",
        type=float,
        default=PlannerConfig().scale_up_cooldown_s,
        help="planner: seconds between two scale-ups of a pool (a worker takes time to start)",
    )
    parser.add_argument(
        "--scale-down-cooldown",
        type=float,
        default=PlannerConfig().scale_down_cooldown_s,
        help="planner: seconds a lower worker count must hold before each step down",
    )
    parser.add_argument(
        "--planner-max-workers",
        type=int,
        default=0,
        help="planner: prefill + decode workers it may ask for, per model (0: no cap)",
    )


def planner_flags(args: argparse.Namespace) -> list[str]:
    """The flags above as given, for a coordinator started by ``pdserve serve``."""
    flags = [
        f"--ttft-slo={args.ttft_slo}",
        f"--tpot-slo={args.tpot_slo}",
        f"--planner-interval={args.planner_interval}",
        f"--planner-window={args.planner_window}",
        f"--scale-up-cooldown={args.scale_up_cooldown}",
        f"--scale-down-cooldown={args.scale_down_cooldown}",
        f"--planner-max-workers={args.planner_max_workers}",
    ]
    return flags + [f"--profile={Path(p).resolve()}" for p in args.profile]


def planner_factory(args: argparse.Namespace) -> Callable[[str], Planner]:
    """A planner per model; raises ValueError for bad SLOs or a profile that does not load."""
    if not (args.ttft_slo > 0 and args.tpot_slo > 0):
        raise ValueError("--ttft-slo and --tpot-slo must be > 0 seconds")
    if args.planner_interval <= 0 or args.planner_max_workers < 0:
        raise ValueError("--planner-interval must be > 0 and --planner-max-workers >= 0")
    if args.planner_window < args.planner_interval:
        raise ValueError("--planner-window must be at least --planner-interval")
    profiles: dict[tuple[str, int], Profile] = {}  # by (model, tensor-parallel size)
    for path in args.profile:
        profile = Profile.load(path)
        if profile.is_derived:  # said wherever a profile is shown
            logger.warning(
                "planner: profile %s is DERIVED, not measured: %s", path, profile.derived
            )
        key = (profile.model, profile.tensor_parallel_size)
        if key in profiles:
            raise ValueError(
                f"two profiles for model {profile.model!r} at tensor-parallel size {key[1]} "
                f"(--profile {path})"
            )
        profiles[key] = profile
    targets = Targets(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo)
    config = PlannerConfig(
        max_workers=args.planner_max_workers or None,
        scale_up_cooldown_s=args.scale_up_cooldown,
        scale_down_cooldown_s=args.scale_down_cooldown,
    )

    def make(model: str) -> Planner:
        given = {tp: p for (name, tp), p in profiles.items() if name == model}
        shipped = None if 1 in given else shipped_profile(model)  # of one rank
        return Planner([*given.values(), *([shipped] if shipped else [])], targets, config)

    return make
