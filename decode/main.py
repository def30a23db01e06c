"""``pdserve decode``: a decode worker (worker/process.py around a ``DecodeWorker``);
``--colocated`` makes it prefill too (role ``both``, the colocated baseline)."""

from __future__ import annotations

import argparse

from pdserve.decode.record import KVFailurePolicy
from pdserve.worker.args import add_worker_args
from pdserve.worker.process import RoleParts, WorkerContext, run_worker


def add_decode_args(parser: argparse.ArgumentParser) -> None:
    g = add_worker_args(parser)
    g.add_argument("--transfer-bind", default=None, help="KV receiver address")
    g.add_argument(
        "--colocated",
        action="store_true",
        help="also prefill locally (role 'both': the colocated baseline)",
    )
    g.add_argument(
        "--kv-failure-policy",
        choices=[p.value for p in KVFailurePolicy],
        default=KVFailurePolicy.RECOMPUTE.value,
        help="when a KV transfer fails: prefill here instead, or end the request",
    )


def run_decode(args: argparse.Namespace) -> int:
    return run_worker(args, "decode", _build)


def _build(args: argparse.Namespace, ctx: WorkerContext) -> RoleParts:
    from pdserve.decode.worker import DecodeWorker
    from pdserve.kvtransfer import make_receiver

    transport = make_receiver(
        args.transfer_backend,
        ctx.engine.status.kv_layers,
        args.transfer_bind,
        require_checksum=args.kv_checksum,
        **ctx.transport_options,
    )
    worker = DecodeWorker(
        engine=ctx.engine,
        receiver=transport,
        worker_id=ctx.worker_id,
        outbox=ctx.outbox,
        transfer_timeout_s=args.transfer_timeout,
        kv_failure_policy=args.kv_failure_policy,
    )
    return RoleParts(
        worker=worker,
        transport=transport,
        transfer_address=transport.address,
        wire_role="both" if args.colocated else "decode",
    )
