"""One worker process around one engine, whatever its role.

The worker binds its control socket (Reserve / PrefillJob / TransferDone / Abort arrive
there), registers with the coordinator, and heartbeats from a thread of its own
(runtime/liveness.py), so a long step never reads as a dead worker. What differs by role
(the worker object, its KV transport) comes from the role's ``main`` as a ``Build``.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.core_board import DECODE_LEND_ROWS, CoreBoard
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_memory import ROLE_SHARES
from pdserve.kvtransfer.base import KVReceiver, KVSender
from pdserve.models.pull import PullError
from pdserve.protocol.codec import Message
from pdserve.protocol.control import Register, Role
from pdserve.protocol.roles import Receiver
from pdserve.protocol.transfer import KVPeers
from pdserve.runtime import security
from pdserve.runtime.gate import RoleGate
from pdserve.runtime.liveness import Liveness
from pdserve.runtime.loop import Drain, PushOutbox, serve, stop_on_signals
from pdserve.runtime.sockets import bound_address, make_socket
from pdserve.runtime.tracing import tracer_from_args
from pdserve.worker.args import HEARTBEAT_PERIOD_S, check_worker_args
from pdserve.worker.base import Record, Worker
from pdserve.worker.health import WorkerHealth
from pdserve.worker.wire import heartbeat, kv_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleParts:
    """What a role's ``main`` builds around the engine."""

    worker: Worker[Record]  # a PrefillWorker or a DecodeWorker
    transport: KVSender | KVReceiver | None  # its KV sender or receiver (closed on exit)
    transfer_address: str = ""  # where prefill workers push KV to it ("" for prefill)
    wire_role: Role | None = None  # what it registers as (default: the role)


@dataclass(frozen=True)
class WorkerContext:
    """What a role needs to build its parts: the engine, its id, the outbox and the KV
    transport options (the ZMQ context whose keys the KV sockets share)."""

    engine: LLMEngine
    worker_id: str
    outbox: PushOutbox
    transport_options: dict[str, object]


Build = Callable[[argparse.Namespace, WorkerContext], RoleParts]


def run_worker(args: argparse.Namespace, role: Role, build: Build) -> int:
    """Start the engine, build the role's parts, register and step until signalled
    (``--health-port``: probes answer from before the engine loads, ``worker/health.py``)."""
    check_worker_args(args, role)
    health = WorkerHealth.start(args)
    engine = _start_engine(args, role)
    worker_id = args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    keys = security.from_env()
    ctx = security.context(keys)
    control, outbox, parts = _open(args, role, build, ctx, engine, worker_id)
    worker = parts.worker
    register = _register(args, parts.wire_role or role, engine, worker_id, control, parts)
    worker.tracer = tracer = tracer_from_args(args, f"pdserve-{register.role}")
    # Register again each period (a restarted coordinator relearns the cluster from it) is
    # the keep-alive; the Heartbeat is built on the loop thread, the only one touching the
    # engine, once a period and at once on drain (serve calls periodic then).
    liveness = Liveness(
        outbox.to_coordinator, register, HEARTBEAT_PERIOD_S, stall_timeout_s=args.stall_timeout
    )
    kv_events = engine.status.kv_event_publisher(worker_id)

    def periodic(now: float) -> None:
        engine.keep_alive()  # a tensor-parallel group's other ranks hear from rank 0
        for events in kv_events.messages():  # what its prefix cache holds, for routing
            outbox.to_coordinator(events)
        queued, draining = worker.queued_prompt_tokens, worker.draining
        failures = worker.kv_failures
        liveness.publish(heartbeat(engine, worker_id, queued, draining, worker.transfers, failures))

    step = worker.step
    board = None
    if args.core_board is not None:
        rows = None if role == "prefill" else DECODE_LEND_ROWS
        board = CoreBoard(args.core_board, args.core_slot, engine.config.threads or 1, rows)
        engine.runner.kernel_threads(board.threads)
        step = _on_board(worker.step, engine, board)
    health.serving(worker, liveness, ctx, args.coordinator)
    log.info(
        "%s worker %s serving %s: control %s",
        register.role,
        worker_id,
        register.model,
        register.control_address,
    )
    try:
        serve_worker(
            args, control, lambda msg: _handle(msg, parts), step, periodic, worker, liveness, keys
        )
    finally:
        if board is not None:
            board.close()
        if parts.transport is not None:
            parts.transport.close()
        outbox.close()
        control.close()
        tracer.close()
        health.close()  # its connection to the coordinator first: term waits for sockets
        ctx.term()
    return 0


def serve_worker(
    args: argparse.Namespace,
    control: zmq.SyncSocket,
    handle: Callable[[Message], None],
    step: Callable[[], bool],
    periodic: Callable[[float], None],
    worker: Drain,
    liveness: Liveness,
    keys: security.Security | None,
) -> None:
    """A worker's loop until signalled (then it drains ``worker``): its control messages, the
    coordinator's key only, each step, and ``periodic`` once a heartbeat period."""
    serve(
        control,
        handle,
        step,
        periodic,
        stop_on_signals(),
        period_s=HEARTBEAT_PERIOD_S,
        drain=worker,
        drain_timeout_s=args.drain_timeout,
        liveness=liveness,
        admit=RoleGate(keys, Receiver.WORKER).admit,
    )


def _on_board(step: Callable[[], bool], engine: LLMEngine, board: CoreBoard) -> Callable[[], bool]:
    """``step``, with the board told before and after whether the engine has work (its cores
    are lent while it has none)."""

    def boarded() -> bool:
        board.set_busy(engine.has_unfinished())
        did = step()
        board.set_busy(engine.has_unfinished())
        return did

    return boarded


def _handle(msg: Message, parts: RoleParts) -> None:
    """A message from the coordinator: the transport's peers, or the worker's."""
    if isinstance(msg, KVPeers):
        if parts.transport is not None:
            added = [(peer.worker_id, peer.regions) for peer in msg.added]
            parts.transport.update_peers(added, msg.gone)
    else:
        parts.worker.handle(msg)


def _start_engine(args: argparse.Namespace, role: Role) -> LLMEngine:
    from pdserve.engine.cli_args import engine_config_from_args

    if args.kv_cache_share is None:  # a prefill worker's cache only holds prompts
        args.kv_cache_share = ROLE_SHARES[role]
    try:
        config: EngineConfig = engine_config_from_args(args)
        return LLMEngine(config)
    except (OSError, ConfigError, PullError) as e:  # no such model, or not one pdserve runs
        raise SystemExit(f"pdserve {role}: {e}") from None


def _open(
    args: argparse.Namespace,
    role: Role,
    build: Build,
    ctx: zmq.SyncContext,
    engine: LLMEngine,
    worker_id: str,
) -> tuple[zmq.SyncSocket, PushOutbox, RoleParts]:
    """The control socket, the outbox to the coordinator, and the role's parts on them."""
    try:
        control = make_socket(ctx, zmq.PULL, args.control_bind, bind=True)
        # dialled once now, not first on the heartbeat thread: a malformed address is a
        # start-up error rather than a traceback from a running worker
        make_socket(ctx, zmq.PUSH, args.coordinator, bind=False).close()
        # the KV sockets (zmq, and nccl's control socket) share this context's keys; nixl
        # opens no ZMQ socket
        zmq_kv = args.transfer_backend != "nixl"
        options: dict[str, object] = {"ctx": ctx} if zmq_kv else {}
        outbox = PushOutbox(ctx, args.coordinator)
        return control, outbox, build(args, WorkerContext(engine, worker_id, outbox, options))
    except OSError as e:  # an address that cannot be bound or dialled
        ctx.destroy(linger=0)
        raise SystemExit(f"pdserve {role}: {e}") from None


def _register(
    args: argparse.Namespace,
    role: Role,
    engine: LLMEngine,
    worker_id: str,
    control: zmq.SyncSocket,
    parts: RoleParts,
) -> Register:
    """What the worker tells the coordinator it is, each heartbeat period."""
    config = engine.config
    return Register(
        role=role,
        worker_id=worker_id,
        model=args.served_model_name or os.path.basename(os.path.normpath(config.model)),
        control_address=advertised(bound_address(control), args.advertise_host),
        transfer_address=advertised(parts.transfer_address, args.advertise_host),
        transfer_backend=args.transfer_backend,
        layout=kv_layout(engine),
        num_blocks=engine.status.num_blocks,
        model_root=os.path.abspath(config.model),
        max_model_len=engine.max_model_len,
        kv_regions=None if parts.transport is None else parts.transport.regions,
        tensor_parallel_size=config.tensor_parallel_size,  # a group registers as one worker
    )


def advertised(address: str, host: str | None) -> str:
    """Swap the bound host (e.g. 0.0.0.0) for the one other nodes should dial."""
    scheme, sep, rest = address.partition("://")
    if host is None or not sep or ":" not in rest:
        return address
    return f"{scheme}://{host}:{rest.rsplit(':', 1)[1]}"
