"""The rollout flags, the coordinator's and ``pdserve serve``'s (which passes them on)::

    --model NAME@VERSION[=DIR]     a version of NAME (the coordinator ignores DIR; serve
                                   starts its pools); the first of a NAME is its stable one
    --canary NAME@VERSION=PCT%     that version's share of NAME's requests to begin with
    --canary-gate                  roll a canary back by itself when it does worse than stable
    --canary-gate-window S, --canary-gate-error-margin F, --canary-gate-ttft-margin F,
    --canary-gate-min-requests N   (coordinator.canary_gate.GateConfig)

Checked before the coordinator starts (``rollouts_from_args``: a ``ValueError`` naming the flag).
"""

from __future__ import annotations

import argparse

from pdserve.coordinator.canary_gate import GateConfig
from pdserve.coordinator.rollouts import RolloutTable

_GATE = GateConfig()


def add_rollout_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, models: bool = True
) -> None:
    """``models``: add ``--model`` too (the coordinator's; serve has its own)."""
    if models:
        parser.add_argument(
            "--model",
            dest="versions",
            action="append",
            default=[],
            metavar="NAME@VERSION",
            help="a version of NAME, served by workers registered as NAME@VERSION (repeat for "
            "each; the first of a NAME is its stable version): requests to NAME are split "
            "between them by weight",
        )
    parser.add_argument(
        "--canary",
        action="append",
        default=[],
        metavar="NAME@VERSION=PCT%",
        help="the share of NAME's requests a version other than the stable one takes to begin "
        "with (repeatable); the stable version takes the rest. Change it on a running cluster "
        "with `pdserve rollout`",
    )
    parser.add_argument(
        "--canary-gate",
        action="store_true",
        help="roll a canary back (its weight to 0) by itself when, over the window, its error "
        "rate or TTFT p99 exceeds the stable version's by the margin; logged with the figures",
    )
    parser.add_argument(
        "--canary-gate-window",
        type=float,
        default=_GATE.window_s,
        metavar="SECONDS",
        help="the canary gate compares what the gateways measured over this window",
    )
    parser.add_argument(
        "--canary-gate-error-margin",
        type=float,
        default=_GATE.error_margin,
        metavar="FRACTION",
        help="a canary whose error rate exceeds the stable's by more than this is rolled back",
    )
    parser.add_argument(
        "--canary-gate-ttft-margin",
        type=float,
        default=_GATE.ttft_margin,
        metavar="FRACTION",
        help="a canary whose TTFT p99 exceeds the stable's by more than this fraction of it is "
        "rolled back (0.5: over 1.5 times)",
    )
    parser.add_argument(
        "--canary-gate-min-requests",
        type=int,
        default=_GATE.min_requests,
        metavar="N",
        help="requests a version needs in the window before the gate compares it",
    )


def rollouts_from_args(args: argparse.Namespace) -> tuple[RolloutTable, GateConfig | None]:
    """The table and gate the flags ask for; ``ValueError`` naming what is wrong."""
    served = [spec.partition("=")[0] for spec in args.versions]
    table = RolloutTable.from_flags(served, args.canary)
    if not args.canary_gate:
        return table, None
    gate = GateConfig(
        window_s=args.canary_gate_window,
        error_margin=args.canary_gate_error_margin,
        ttft_margin=args.canary_gate_ttft_margin,
        min_requests=args.canary_gate_min_requests,
    )
    return table, gate


def rollout_flags(args: argparse.Namespace, versions: list[str]) -> list[str]:
    """The coordinator's rollout flags from serve's (``versions``: its NAME@VERSION names)."""
    flags = [f"--model={v}" for v in versions] + [f"--canary={c}" for c in args.canary]
    if args.canary_gate:
        flags += [
            "--canary-gate",
            f"--canary-gate-window={args.canary_gate_window}",
            f"--canary-gate-error-margin={args.canary_gate_error_margin}",
            f"--canary-gate-ttft-margin={args.canary_gate_ttft_margin}",
            f"--canary-gate-min-requests={args.canary_gate_min_requests}",
        ]
    return flags
