"""``pdserve coordinator``: the coordinator process around ``Coordinator``."""

from __future__ import annotations

import argparse
import logging
import os
import time

import zmq

from pdserve import envs
from pdserve.coordinator.coordinator import Coordinator
from pdserve.coordinator.holds import DEFAULT_HOLD_S
from pdserve.coordinator.planner_args import add_planner_args, planner_factory
from pdserve.coordinator.policies import HOT_SPOT_TOKENS, ROUTING_MODES
from pdserve.coordinator.rollout_args import add_rollout_args, rollouts_from_args
from pdserve.protocol.codec import Message
from pdserve.protocol.roles import Receiver
from pdserve.runtime import security
from pdserve.runtime.gate import RoleGate
from pdserve.runtime.health_http import LoopTicks, add_health_args, start_health
from pdserve.runtime.loop import PushOutbox, RateLimitedLog, serve, stop_on_signals
from pdserve.runtime.sockets import bound_address, make_socket
from pdserve.runtime.tracing import add_otlp_args, tracer_from_args

log = logging.getLogger(__name__)

GATEWAY_IDLE_S = 30.0  # a gateway hellos every second: one silent this long is gone
# /livez, /readyz (--health-port): the loop ticks every 0.5 s; not for this long is stalled,
# and ready is a first tick and one within LOOP_READY_S
LOOP_STALL_S = 30.0
LOOP_READY_S = 5.0


class _Outbox(PushOutbox):
    """Sockets to workers (one per registered worker) and to gateways: at most
    ``max_gateways`` of them, each closed once silent for ``GATEWAY_IDLE_S``, so a flood of
    ``GatewayHello`` with made-up addresses cannot use up this process's sockets."""

    def __init__(self, ctx: zmq.SyncContext, max_gateways: int = 64) -> None:
        super().__init__(ctx)
        self.worker_addresses: dict[str, str] = {}
        self.max_gateways = max_gateways
        self.gateways: dict[str, float] = {}  # stream address -> last message sent there
        self._refused = RateLimitedLog()

    def to_worker(self, worker_id: str, address: str, msg: Message) -> None:
        self.worker_addresses[worker_id] = address
        self.send(address, msg)

    def forget_worker(self, worker_id: str) -> None:
        address = self.worker_addresses.pop(worker_id, None)
        if address is not None:
            self.forget(address)

    def to_gateway(self, address: str, msg: Message) -> None:
        if address not in self.gateways and len(self.gateways) >= self.max_gateways:
            self._refused.error(
                "gateways",
                "refused %s to gateway %s: %d gateways are connected already (--max-gateways)",
                type(msg).__name__,
                address,
                len(self.gateways),
            )
            return
        self.gateways[address] = time.monotonic()
        self.send(address, msg)

    def expire_gateways(self, now: float) -> None:
        for address, seen in list(self.gateways.items()):
            if now - seen > GATEWAY_IDLE_S:
                del self.gateways[address]
                self.forget(address)


def add_coordinator_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bind",
        default=envs.coordinator_bind(),
        help="inbox address gateways and workers push to (port 0: any free)",
    )
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--reserve-timeout",
        type=float,
        default=5.0,
        help="seconds a decode worker has to answer a reservation before another is asked",
    )
    parser.add_argument(
        "--prefill-timeout",
        type=float,
        default=120.0,
        help="seconds a prefill job has to finish its KV transfer before it moves elsewhere",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=60.0,
        help="seconds a request may wait for free decode KV blocks before a 503",
    )
    parser.add_argument(
        "--max-gateways", type=int, default=64, help="gateways served at once (the rest wait)"
    )
    add_routing_args(parser)
    add_planner_args(parser)
    add_rollout_args(parser.add_argument_group("rollouts (versions of a model behind one name)"))
    parser.add_argument(
        "--address-file", default=None, help="write the bound inbox address here once listening"
    )
    add_health_args(parser)
    add_otlp_args(parser)


def add_routing_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Placement and conditional disaggregation (the coordinator's; ``pdserve serve`` passes
    them on)."""
    parser.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        default="kv",
        help="how a prefill worker is picked: kv (fewest prompt tokens to compute, from the "
        "workers' prefix caches, plus its queue), load (shortest queue), round-robin; decode "
        "workers go by free blocks (round-robin: in turn)",
    )
    parser.add_argument(
        "--kv-hot-spot-tokens",
        type=int,
        default=HOT_SPOT_TOKENS,
        help="kv routing: a worker whose prompt-token queue is this much longer than the "
        "shortest one does not take a request for its cache (0: no guard)",
    )
    parser.add_argument(
        "--max-local-prefill-tokens",
        type=_local_tokens,
        default="auto",
        metavar="N|auto",
        help="prompts whose part not cached on their decode worker is at most this many tokens "
        "are prefilled by that worker, with no KV transfer (0: off; auto: the planner's "
        "figure, from the model's profile and the load)",
    )
    parser.add_argument(
        "--max-prefill-queue-tokens",
        type=int,
        default=0,
        help="while every prefill worker has more prompt tokens than this queued, decode "
        "workers prefill new requests themselves (0: off)",
    )
    parser.add_argument(
        "--hold-timeout",
        type=_seconds,
        default=DEFAULT_HOLD_S,
        help="seconds a request waits for a worker while its model has none that can take it "
        "(a restart) before a 503 (0: refused at once)",
    )


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds, not {value!r}") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return seconds


def _local_tokens(value: str) -> str | int:
    if value == "auto":
        return value
    try:
        tokens = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a token count or 'auto', not {value!r}") from None
    if tokens < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0: off)")
    return tokens


def routing_flags(args: argparse.Namespace) -> list[str]:
    return [
        f"--routing={args.routing}",
        f"--kv-hot-spot-tokens={args.kv_hot_spot_tokens}",
        f"--max-local-prefill-tokens={args.max_local_prefill_tokens}",
        f"--max-prefill-queue-tokens={args.max_prefill_queue_tokens}",
        f"--hold-timeout={args.hold_timeout}",
    ]


def run_coordinator(args: argparse.Namespace) -> int:
    if args.max_gateways < 1:
        raise SystemExit("pdserve coordinator: --max-gateways must be at least 1")
    if args.kv_hot_spot_tokens < 0:
        raise SystemExit("pdserve coordinator: --kv-hot-spot-tokens must be >= 0 (0: no guard)")
    try:
        planners = planner_factory(args)
        rollouts, canary_gate = rollouts_from_args(args)
    except ValueError as e:
        raise SystemExit(f"pdserve coordinator: {e}") from e
    auto_local = args.max_local_prefill_tokens == "auto"
    keys = security.from_env()
    ctx = security.context(keys)
    inbox = make_socket(ctx, zmq.PULL, args.bind, bind=True)
    address = bound_address(inbox)
    outbox = _Outbox(ctx, args.max_gateways)
    coordinator = Coordinator(
        outbox,
        args.heartbeat_timeout,
        reserve_timeout_s=args.reserve_timeout,
        prefill_timeout_s=args.prefill_timeout,
        queue_timeout_s=args.queue_timeout,
        max_local_prefill_tokens=0 if auto_local else args.max_local_prefill_tokens,
        max_prefill_queue_tokens=args.max_prefill_queue_tokens,
        routing=args.routing,
        hot_spot_tokens=args.kv_hot_spot_tokens,
        make_planner=planners,
        planner_interval_s=args.planner_interval,
        planner_window_s=args.planner_window,
        auto_local=auto_local,
        hold_timeout_s=args.hold_timeout,
        rollouts=rollouts,
        canary_gate=canary_gate,
    )
    coordinator.shared.tracer = tracer = tracer_from_args(args, "pdserve-coordinator")
    if args.address_file:
        tmp = f"{args.address_file}.tmp"
        with open(tmp, "w") as f:
            f.write(address)
        os.replace(tmp, args.address_file)
    log.info("coordinator listening on %s", address)
    print(f"coordinator inbox: {address}", flush=True)
    stop = stop_on_signals()
    ticks = LoopTicks(stall_s=LOOP_STALL_S, ready_s=LOOP_READY_S)
    health = start_health(args, ticks.livez, ticks.readyz)

    def periodic(now: float) -> None:
        ticks.tick(now)
        coordinator.tick(now)
        outbox.expire_gateways(now)

    try:
        serve(
            inbox,
            lambda msg, sender: coordinator.handle(msg, time.monotonic(), sender),
            lambda: False,
            periodic,
            stop,
            period_s=0.5,
            idle_wait_ms=50,
            with_sender=True,
            admit=RoleGate(keys, Receiver.COORDINATOR).admit,  # who may send what (roles)
        )
    finally:
        tracer.close()
        if health is not None:
            health.close()
        outbox.close()
        inbox.close()
        ctx.term()
    return 0
