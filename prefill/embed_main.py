"""``pdserve prefill --model <an embedding model>``: the embed worker's process (prefill/embed.py
holds the worker). The same plumbing as any worker's (worker/process.py): its control socket,
registration each period, heartbeats from the loop, drain on SIGTERM, probes with
``--health-port``; no engine, no KV cache, no transport.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import zmq

from pdserve.engine.embed.model import EmbeddingModel, model_kind
from pdserve.engine.embed.sentence_config import EmbeddingConfigError
from pdserve.prefill.embed import EmbedWorker, embed_register, new_worker_id
from pdserve.runtime import security
from pdserve.runtime.liveness import Liveness
from pdserve.runtime.loop import PushOutbox
from pdserve.runtime.sockets import bound_address, make_socket
from pdserve.worker.args import HEARTBEAT_PERIOD_S, check_worker_args
from pdserve.worker.health import WorkerHealth
from pdserve.worker.process import advertised, serve_worker

log = logging.getLogger(__name__)


def is_embedding_model(path: str) -> bool:
    """A BERT encoder, or a decoder whose sentence-transformers modules.json asks for pooling
    (served for embeddings only; a chat model has no modules.json)."""
    root = Path(path)
    try:
        kind = model_kind(root)
    except (EmbeddingConfigError, ValueError, OSError):
        return False
    if kind == "bert":
        return True
    modules = root / "modules.json"
    if not modules.is_file():
        return False
    listed = json.loads(modules.read_text())
    return isinstance(listed, list) and any(
        str(m.get("type", "")).endswith("Pooling") for m in listed if isinstance(m, dict)
    )


def run_embed(args: argparse.Namespace) -> int:
    """Load the model, register as ``embed`` and step until signalled."""
    check_worker_args(args, "prefill")
    health = WorkerHealth.start(args)
    try:
        model = EmbeddingModel.from_dir(args.model, threads=args.threads)
    except (OSError, ValueError) as e:
        raise SystemExit(f"pdserve prefill: {e}") from None
    worker_id = new_worker_id(args)
    keys = security.from_env()
    ctx = security.context(keys)
    try:
        control = make_socket(ctx, zmq.PULL, args.control_bind, bind=True)
        outbox = PushOutbox(ctx, args.coordinator)
    except OSError as e:
        ctx.destroy(linger=0)
        raise SystemExit(f"pdserve prefill: {e}") from None
    worker = EmbedWorker(model, worker_id, outbox)
    address = advertised(bound_address(control), args.advertise_host)
    register = embed_register(args, model, worker_id, address)
    liveness = Liveness(
        outbox.to_coordinator, register, HEARTBEAT_PERIOD_S, stall_timeout_s=args.stall_timeout
    )
    health.serving(worker, liveness, ctx, args.coordinator)
    log.info(
        "embed worker %s serving %s (%s, %d dimensions, %d tokens an input): control %s",
        worker_id,
        register.model,
        model.kind,
        model.dim,
        model.max_seq_len,
        address,
    )

    def periodic(now: float) -> None:
        liveness.publish(worker.heartbeat())

    try:
        serve_worker(args, control, worker.handle, worker.step, periodic, worker, liveness, keys)
    finally:
        outbox.close()
        control.close()
        health.close()
        ctx.term()
    return 0
