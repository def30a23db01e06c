"""The flags both worker roles take (each role adds its own in its ``main``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve import envs
from pdserve.engine.cli_args import add_engine_args
from pdserve.kvtransfer import backends as transfer_backends
from pdserve.runtime.health_http import add_health_args
from pdserve.runtime.tracing import add_otlp_args

HEARTBEAT_PERIOD_S = 1.0  # the coordinator's timeout (5 s) allows a few to go missing


def add_worker_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Engine flags and the worker group; returns the group for the role's own flags."""
    add_engine_args(parser)
    g = parser.add_argument_group("worker")
    g.add_argument(
        "--coordinator",
        default=envs.coordinator_address(),
        help="coordinator inbox address (env PDSERVE_COORDINATOR)",
    )
    g.add_argument(
        "--control-bind",
        default="tcp://127.0.0.1:0",
        help="where this worker takes commands (port 0: any free one)",
    )
    g.add_argument(
        "--advertise-host",
        default=None,
        help="host other nodes reach this worker at (default: the bound one)",
    )
    g.add_argument("--transfer-backend", default="zmq", choices=transfer_backends())
    g.add_argument("--transfer-timeout", type=float, default=30.0, help="seconds")
    g.add_argument(
        "--no-kv-checksum",
        dest="kv_checksum",
        action="store_false",
        help="skip the per-transfer checksum (on by default: corruption is caught)",
    )
    g.add_argument("--worker-id", default=None)
    g.add_argument(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="seconds the step loop may go without coming round (far longer than any step) "
        "before heartbeats stop and every thread's stack is logged",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to finish work in flight before exiting",
    )
    g.add_argument(
        "--core-board",
        type=Path,
        default=None,
        help="a file the workers of one host share (pdserve serve makes one per launch): "
        "this worker's quantized layers also use the cores of workers idle now",
    )
    g.add_argument("--core-slot", type=int, default=0, help="this worker's slot on --core-board")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model directory's name)",
    )
    add_health_args(g)
    add_otlp_args(g)
    return g


def check_worker_args(args: argparse.Namespace, role: str) -> None:
    """Refuse flags no worker can run with (a ``SystemExit`` naming the flag)."""
    if not args.coordinator:
        raise SystemExit(f"pdserve {role}: --coordinator (or PDSERVE_COORDINATOR) is required")
    if not args.stall_timeout > HEARTBEAT_PERIOD_S:
        raise SystemExit(
            f"pdserve {role}: --stall-timeout must be longer than the heartbeat period "
            f"({HEARTBEAT_PERIOD_S:g}s), got {args.stall_timeout:g}"
        )


def check_stream_chunks(args: argparse.Namespace, command: str) -> None:
    """``--kv-stream-chunks`` (prefill workers, ``pdserve serve``) only where the transfer
    backend can send a transfer in parts (nixl): a ``SystemExit`` saying so otherwise."""
    if args.kv_stream_chunks and args.transfer_backend != "nixl":
        raise SystemExit(
            f"pdserve {command}: --kv-stream-chunks needs --transfer-backend nixl (the decode "
            f"worker reads each part while later chunks compute), not {args.transfer_backend}"
        )


def model_dir(args: argparse.Namespace, role: str) -> str:
    """``--model`` as a directory (a pulled model's name resolved, pulled if need be), or a
    ``SystemExit`` saying why not."""
    from pdserve.models.store import resolve_model

    try:
        return resolve_model(args.model, args.dtype)
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"pdserve {role}: {e}") from None
