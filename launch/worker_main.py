"""``pdserve prefill`` and ``pdserve decode``: one worker process around one engine.

The worker binds its control socket (Reserve / PrefillJob / TransferDone / Abort arrive
there), a KV receiver where it decodes, registers with the coordinator, and heartbeats from
a thread of its own (protocol/liveness.py), so a long step never reads as a dead worker.
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid

import zmq

from engine import envs
from engine.cli_args import add_engine_args, engine_config_from_args
from kvtransfer import backends as transfer_backends
from protocol import messages as m
from protocol import security
from protocol.liveness import Liveness
from protocol.loop import PushOutbox, serve, stop_on_signals
from protocol.sockets import bound_address, make_socket

log = logging.getLogger(__name__)

HEARTBEAT_PERIOD_S = 1.0  # the coordinator's timeout (5 s) allows a few to go missing


def add_worker_args(parser: argparse.ArgumentParser, role: str) -> None:
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
    g.add_argument("--transfer-bind", default=None, help="KV receiver address (decode)")
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
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model directory's name)",
    )
    if role == "decode":
        g.add_argument(
            "--colocated",
            action="store_true",
            help="also prefill locally (role 'both': the colocated baseline)",
        )
        g.add_argument(
            "--kv-failure-policy",
            choices=["recompute", "fail"],
            default="recompute",
            help="when a KV transfer fails: prefill here instead, or end the request",
        )
    else:
        g.add_argument(
            "--kv-fault",
            default=None,
            metavar="MODE[:RATE[:DELAY_S]]",
            help="inject transfer faults (testing): drop, delay, truncate, corrupt",
        )


def run_worker(args: argparse.Namespace, role: str) -> int:
    if not args.coordinator:
        raise SystemExit(f"pdserve {role}: --coordinator (or PDSERVE_COORDINATOR) is required")
    if not args.stall_timeout > HEARTBEAT_PERIOD_S:
        raise SystemExit(
            f"pdserve {role}: --stall-timeout must be longer than the heartbeat period "
            f"({HEARTBEAT_PERIOD_S:g}s), got {args.stall_timeout:g}"
        )
    from engine.engine import LLMEngine
    from engine.kv_events import KVEventPublisher
    from engine.wire import heartbeat, kv_layout
    from kvtransfer import make_receiver, make_sender

    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    wire_role = "both" if role == "decode" and args.colocated else role
    worker_id = args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    served = args.served_model_name or os.path.basename(os.path.normpath(config.model))

    options: dict = {}
    ctx = security.context(security.from_env())
    control = make_socket(ctx, zmq.PULL, args.control_bind, bind=True)
    # the KV sockets (zmq, and the GPU backends' control socket) share this context's keys
    if args.transfer_backend != "ucx":
        options["ctx"] = ctx
    outbox = PushOutbox(ctx, args.coordinator)
    layers = engine.runner.kv_cache.layers
    if role == "prefill":
        from prefill.worker import PrefillWorker

        if args.kv_fault:
            from kvtransfer.faults import FaultPlan

            options["fault"] = FaultPlan.parse(args.kv_fault)
        transport = make_sender(args.transfer_backend, checksum=args.kv_checksum, **options)
        worker = PrefillWorker(engine, transport, worker_id, outbox, args.transfer_timeout)
        transfer_address = ""
    else:
        from decode.worker import DecodeWorker

        transport = make_receiver(
            args.transfer_backend,
            layers,
            args.transfer_bind,
            require_checksum=args.kv_checksum,
            **options,
        )
        worker = DecodeWorker(
            engine, transport, worker_id, outbox, args.transfer_timeout, args.kv_failure_policy
        )
        transfer_address = _advertised(transport.address, args.advertise_host)
    register = m.Register(
        role=wire_role,
        worker_id=worker_id,
        model=served,
        control_address=_advertised(bound_address(control), args.advertise_host),
        transfer_address=transfer_address,
        transfer_backend=args.transfer_backend,
        layout=kv_layout(engine),
        num_blocks=engine.block_manager.num_blocks,
        model_root=os.path.abspath(config.model),
        max_model_len=engine.max_model_len,
    )

    kv_events = KVEventPublisher(engine.block_manager, worker_id)

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
        transport.close()
        outbox.close()
        control.close()
        ctx.term()
    return 0


def _advertised(address: str, host: str | None) -> str:
    """Swap the bound host (e.g. 0.0.0.0) for the one other nodes should dial."""
    scheme, sep, rest = address.partition("://")
    if host is None or not sep or ":" not in rest:
        return address
    return f"{scheme}://{host}:{rest.rsplit(':', 1)[1]}"
