"""``pdserve coordinator``: the coordinator process around ``Coordinator``."""

from __future__ import annotations

import argparse
import logging
import os
import time

import zmq

from coordinator.coordinator import Coordinator
from engine import envs
from protocol.loop import PushOutbox, serve, stop_on_signals
from protocol.sockets import bound_address, make_socket

log = logging.getLogger(__name__)


class _Outbox(PushOutbox):
    def __init__(self, ctx: zmq.Context) -> None:
        super().__init__(ctx)
        self.worker_addresses: dict[str, str] = {}

    def to_worker(self, worker_id: str, address: str, msg) -> None:
        self.worker_addresses[worker_id] = address
        self.send(address, msg)

    def forget_worker(self, worker_id: str) -> None:
        address = self.worker_addresses.pop(worker_id, None)
        if address is not None:
            self.forget(address)


def add_coordinator_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bind",
        default=envs.coordinator_bind(),
        help="inbox address gateways and workers push to (port 0: any free)",
    )
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--address-file", default=None, help="write the bound inbox address here once listening"
    )


def run_coordinator(args: argparse.Namespace) -> int:
    ctx = zmq.Context()
    inbox = make_socket(ctx, zmq.PULL, args.bind, bind=True)
    address = bound_address(inbox)
    outbox = _Outbox(ctx)
    coordinator = Coordinator(outbox, args.heartbeat_timeout)
    if args.address_file:
        tmp = f"{args.address_file}.tmp"
        with open(tmp, "w") as f:
            f.write(address)
        os.replace(tmp, args.address_file)
    log.info("coordinator listening on %s", address)
    print(f"coordinator inbox: {address}", flush=True)
    stop = stop_on_signals()
    try:
        serve(
            inbox,
            lambda msg: coordinator.handle(msg, time.monotonic()),
            lambda: False,
            coordinator.tick,
            stop,
            period_s=0.5,
            idle_wait_ms=50,
        )
    finally:
        outbox.close()
        inbox.close()
        ctx.term()
    return 0
