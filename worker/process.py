"""One worker process around one engine, whatever its role.

The worker binds its control socket (Reserve / PrefillJob / TransferDone / Abort arrive
there), registers with the coordinator, and heartbeats from a thread of its own
(protocol/liveness.py), so a long step never reads as a dead worker. What differs by role
(the worker object, its KV transport) comes from the role's ``main`` as a ``Build``.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol import messages as m
from pdserve.protocol import security
from pdserve.protocol.liveness import Liveness
from pdserve.protocol.loop import PushOutbox, serve, stop_on_signals
from pdserve.protocol.sockets import bound_address, make_socket
from pdserve.worker.args import HEARTBEAT_PERIOD_S, check_worker_args

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleParts:
    """What a role's ``main`` builds around the engine."""

    worker: Any  # PrefillWorker | DecodeWorker: handle, step, draining, queued_prompt_tokens
    transport: Any  # its KV sender or receiver (closed on exit)
    transfer_address: str = ""  # where prefill workers push KV to it ("" for prefill)
    wire_role: str = ""  # what it registers as (default: the role)


@dataclass(frozen=True)
class WorkerContext:
    """What a role needs to build its parts: the engine, its id, the outbox and the KV
    transport options (the ZMQ context whose keys the KV sockets share)."""

    engine: LLMEngine
    worker_id: str
    outbox: PushOutbox
    transport_options: dict[str, Any]


Build = Callable[[argparse.Namespace, WorkerContext], RoleParts]


def run_worker(args: argparse.Namespace, role: str, build: Build) -> int:
    """Start the engine, build the role's parts, register and step until signalled."""
    check_worker_args(args, role)
    from pdserve.engine.cli_args import engine_config_from_args
    from pdserve.worker.wire import heartbeat, kv_layout

    config: EngineConfig = engine_config_from_args(args)
    engine = LLMEngine(config)
    worker_id = args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    served = args.served_model_name or os.path.basename(os.path.normpath(config.model))

    ctx = security.context(security.from_env())
    control = make_socket(ctx, zmq.PULL, args.control_bind, bind=True)
    # the KV sockets (zmq, and the GPU backends' control socket) share this context's keys
    options: dict[str, Any] = {} if args.transfer_backend == "ucx" else {"ctx": ctx}
    outbox = PushOutbox(ctx, args.coordinator)
    parts = build(args, WorkerContext(engine, worker_id, outbox, options))
    worker = parts.worker
    wire_role = parts.wire_role or role
    register = m.Register(
        role=wire_role,
        worker_id=worker_id,
        model=served,
        control_address=advertised(bound_address(control), args.advertise_host),
        transfer_address=advertised(parts.transfer_address, args.advertise_host),
        transfer_backend=args.transfer_backend,
        layout=kv_layout(engine),
        num_blocks=engine.num_blocks,
        model_root=os.path.abspath(config.model),
        max_model_len=engine.max_model_len,
    )

    kv_events = engine.kv_event_publisher(worker_id)

    # Register again each period (a restarted coordinator relearns the cluster from it) is
    # the keep-alive; the Heartbeat is built on the loop thread, the only one touching the
    # engine, once a period and at once on drain (serve calls periodic then).
    liveness = Liveness(
        outbox.to_coordinator, register, HEARTBEAT_PERIOD_S, stall_timeout_s=args.stall_timeout
    )

    def periodic(now: float) -> None:
        for events in kv_events.messages():  # what its prefix cache holds, for routing
            outbox.to_coordinator(events)
        transfers = getattr(worker, "transfers", None)  # a prefill worker's KV pushes
        liveness.publish(
            heartbeat(engine, worker_id, worker.queued_prompt_tokens, worker.draining, transfers)
        )

    log.info(
        "%s worker %s serving %s: control %s",
        wire_role,
        worker_id,
        served,
        register.control_address,
    )
    stop = stop_on_signals()
    try:
        serve(
            control,
            worker.handle,
            worker.step,
            periodic,
            stop,
            period_s=HEARTBEAT_PERIOD_S,
            drain=worker,
            drain_timeout_s=args.drain_timeout,
            liveness=liveness,
        )
    finally:
        parts.transport.close()
        outbox.close()
        control.close()
        ctx.term()
    return 0


def advertised(address: str, host: str | None) -> str:
    """Swap the bound host (e.g. 0.0.0.0) for the one other nodes should dial."""
    scheme, sep, rest = address.partition("://")
    if host is None or not sep or ":" not in rest:
        return address
    return f"{scheme}://{host}:{rest.rsplit(':', 1)[1]}"
