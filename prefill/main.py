"""``pdserve prefill``: a prefill worker (worker/process.py around a ``PrefillWorker``)."""

from __future__ import annotations

import argparse
import logging

from pdserve.kvtransfer.faults import FaultPlan
from pdserve.worker.args import add_worker_args, check_stream_chunks, check_worker_args, model_dir
from pdserve.worker.process import RoleParts, WorkerContext, run_worker

logger = logging.getLogger(__name__)


def add_prefill_args(parser: argparse.ArgumentParser) -> None:
    g = add_worker_args(parser)
    g.add_argument(
        "--kv-fault",
        type=_fault_plan,
        default=None,
        metavar="MODE[:RATE[:DELAY_S]]",
        help="inject transfer faults (testing): drop, delay, truncate, corrupt",
    )
    g.add_argument(
        "--kv-stream-chunks",
        action="store_true",
        help="offer a long prompt's KV chunk by chunk as its chunks complete, so the decode "
        "worker reads it while later chunks compute (--transfer-backend nixl only)",
    )


def _fault_plan(text: str) -> FaultPlan:
    """``--kv-fault``, checked when the flags are parsed (before the model loads)."""
    try:
        return FaultPlan.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def run_prefill(args: argparse.Namespace) -> int:
    """A prefill worker; of an embedding model, an embed worker (prefill/embed_main.py)."""
    from pdserve.prefill.embed_main import is_embedding_model, run_embed

    check_stream_chunks(args, "prefill")  # flags first: before the model is looked for
    check_worker_args(args, "prefill")
    path = model_dir(args, "prefill")
    if is_embedding_model(path):
        args.model = path
        return run_embed(args)
    return run_worker(args, "prefill", _build)


def _build(args: argparse.Namespace, ctx: WorkerContext) -> RoleParts:
    from pdserve.kvtransfer import make_sender
    from pdserve.prefill.worker import PrefillWorker

    options = dict(ctx.transport_options)
    if args.kv_fault is not None:
        options["fault"] = args.kv_fault
    if args.transfer_backend == "nixl":  # a one-sided transport registers its cache up front
        options["kv_layers"] = ctx.engine.status.kv_layers
    transport = make_sender(args.transfer_backend, checksum=args.kv_checksum, **options)
    if args.kv_stream_chunks:
        logger.info("prefill: a prompt's KV is offered chunk by chunk (--kv-stream-chunks)")
    worker = PrefillWorker(
        engine=ctx.engine,
        sender=transport,
        worker_id=ctx.worker_id,
        outbox=ctx.outbox,
        transfer_timeout_s=args.transfer_timeout,
        stream_chunks=args.kv_stream_chunks,
    )
    return RoleParts(worker=worker, transport=transport)
