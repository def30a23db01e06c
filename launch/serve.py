"""``pdserve serve``: every role on this machine, each its own ``pdserve <role>`` process.

    coordinator ◀── workers register ── prefill × P, decode × D   (or colocated × P+D)
         ▲
    gateway (OpenAI API on --port)

Cores are split between the workers (``--threads`` each) and, with ``--pin``, each worker is
pinned to its own cores. A role that dies is restarted (it re-registers by itself). Ctrl-C or
SIGTERM drains: the gateway finishes its streams, then the workers and the coordinator stop.
With ``--autoscale`` the workers follow the planner's plan (``launch/autoscale.py``): started,
retired by drain (not restarted), turned between prefill and decode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pdserve.coordinator.main import add_routing_args, routing_flags
from pdserve.coordinator.planner_args import add_planner_args, planner_flags
from pdserve.coordinator.rollout_args import add_rollout_args, rollout_flags, rollouts_from_args
from pdserve.kvtransfer import backends as transfer_backends
from pdserve.launch.autoscale import (
    Autoscaler,
    Proc,
    add_autoscale_args,
    check_autoscale_args,
    slot_name,
)
from pdserve.launch.children import Child, restart, wait_for_file
from pdserve.launch.plan_source import metrics_source, planner_source
from pdserve.launch.serve_api import add_serve_api_args, gateway_api_flags, served_name
from pdserve.launch.serve_keys import identities, launch_keys, role_of, worker_id, worker_keys
from pdserve.launch.versions import mark_expendable, rollout_hint, take_versions
from pdserve.launch.worker_commands import (
    embed_commands,
    pdserve_command,
    split_models,
    worker_command,
    worker_commands,
)
from pdserve.runtime.tracing import add_otlp_args, otlp_flags


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from pdserve.engine.cli_args import add_engine_args

    add_engine_args(parser, many_models=True)
    g = parser.add_argument_group("cluster")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers (--autoscale: first)")
    g.add_argument("--decode", type=int, default=1, help="decode workers (--autoscale: first)")
    g.add_argument(
        "--prefill-tp",
        type=int,
        default=None,
        help="tensor-parallel size of each prefill worker (default: --tp)",
    )
    g.add_argument(
        "--decode-tp",
        type=int,
        default=None,
        help="tensor-parallel size of each decode worker (default: --tp); each pool its own",
    )
    add_autoscale_args(g)
    g.add_argument(
        "--mode",
        choices=["disagg", "colocated"],
        default="disagg",
        help="colocated: prefill+decode workers all run both phases",
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--transfer-backend", default="zmq", choices=transfer_backends())
    g.add_argument(
        "--transfer-timeout",
        type=float,
        default=30.0,
        help="seconds from a decode worker's reservation until its prompt's KV must be in "
        "(the prompt's prefill included): raise it for prompts that take longer here",
    )
    g.add_argument("--pin", action="store_true", help="pin each worker to its own cores")
    g.add_argument(
        "--no-lend-cores",
        dest="lend_cores",
        action="store_false",
        help="keep each worker to its own threads (by default a worker's quantized layers also "
        "run on the cores of workers idle at the moment: engine/core_board.py)",
    )
    add_serve_api_args(g)
    g.add_argument("--ready-timeout", type=float, default=120.0, help="seconds")
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on Ctrl-C/SIGTERM, seconds to finish streams in flight",
    )
    g.add_argument(
        "--kv-failure-policy",
        choices=["recompute", "fail"],
        default="recompute",
        help="decode workers, when a KV transfer fails: prefill locally, or fail the request",
    )
    g.add_argument(
        "--kv-fault",
        default=None,
        metavar="MODE[:RATE[:DELAY_S]]",
        help="inject KV transfer faults on prefill workers (testing): drop, delay, truncate, "
        "corrupt",
    )
    g.add_argument(
        "--kv-stream-chunks",
        action="store_true",
        help="prefill workers offer a long prompt's KV chunk by chunk, read while later chunks "
        "compute (--transfer-backend nixl only)",
    )
    add_routing_args(g)
    add_planner_args(g)
    add_rollout_args(g, models=False)  # --model NAME@VERSION=DIR: launch/versions.py
    g.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times a stream may move to another decode worker when its worker dies",
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="no CURVE keys on internal sockets (by default each launch makes its own)",
    )
    add_otlp_args(g)  # passed on to every role
    g.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="times a role that dies is restarted before serve gives up",
    )


def run_serve(args: argparse.Namespace) -> int:
    from pdserve.models.store import resolve_model
    from pdserve.worker.args import check_stream_chunks

    check_stream_chunks(args, "serve")
    problem = check_autoscale_args(args, os.cpu_count() or 1)
    if problem is not None:
        print(f"pdserve serve: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the gateway runs: nothing to reload

    try:  # pulled here, once, so the workers start from the cache
        versions = take_versions(args, lambda m: resolve_model(m, args.dtype))
        rollouts_from_args(args)  # checked here: the coordinator would fail
        default = [] if versions else [None]  # versions alone: no default model
        models = [os.path.abspath(resolve_model(m, args.dtype)) for m in args.model or default]
        model = split_models(args, models)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-"))  # 0700
    try:
        api_flags = gateway_api_flags(args, run_dir)
    except ValueError as e:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    keys = launch_keys(run_dir, identities(args), args.insecure)
    args.core_board = run_dir / "cores" if args.lend_cores and not args.pin else None
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    cluster = Cluster(args, keys, run_dir / "coordinator")
    signal.signal(signal.SIGHUP, lambda *_: cluster.reload_tenants())
    try:
        cluster.start(model, api_flags)
        mark_expendable(cluster.workers, args)
        if versions:
            keys_dir = None if args.insecure else run_dir / "keys"
            print(f"pdserve serve: rollouts: {rollout_hint(cluster.address, keys_dir)}", flush=True)
        scaler = cluster.autoscaler(served_name(args) or Path(model).name)
        _supervise(cluster, args, model, stopping, scaler)
        return 0
    except RuntimeError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop(args.drain_timeout)
        shutil.rmtree(run_dir, ignore_errors=True)


class Cluster:
    """The role processes of one ``pdserve serve`` and their command lines: the coordinator
    starts first (the others need its address), the gateway stops first (it drains its streams
    while the workers still serve them)."""

    def __init__(
        self, args: argparse.Namespace, keys: Callable[[str], list[str]], address_file: Path
    ) -> None:
        self.args = args
        self.keys = keys
        self.address_file = address_file
        self.pdserve = pdserve_command()
        bind = "tcp://127.0.0.1:0"
        self.coordinator = Child("coordinator", self._coordinator(bind, address_file))
        self.workers: list[Child] = []  # supervised: restarted when they exit
        self.embedders: list[Child] = []  # embed workers (supervised, never autoscaled)
        self.retiring: list[Child] = []  # draining (--autoscale): left to exit
        self.gateway: Child | None = None
        self.address = self.model = ""

    def _coordinator(self, bind: str, address_file: Path | None = None) -> list[str]:
        cmd = [*self.pdserve, "coordinator", f"--bind={bind}"]
        if address_file is not None:
            cmd.append(f"--address-file={address_file}")
        flags = [*routing_flags(self.args), *planner_flags(self.args), *otlp_flags(self.args)]
        flags += rollout_flags(self.args, getattr(self.args, "versions", []))
        return [*cmd, *flags, *self.keys("coordinator")]

    def _gateway(self, address: str, api_flags: list[str]) -> list[str]:
        args = self.args
        return [
            *self.pdserve,
            "gateway",
            f"--coordinator={address}",
            f"--host={args.host}",
            f"--port={args.port}",
            f"--drain-timeout={args.drain_timeout}",
            f"--max-migrations={args.max_migrations}",
            *otlp_flags(args),
            *api_flags,
            *self.keys("gateway"),
        ]

    def start(self, model: str, api_flags: list[str]) -> None:
        self.coordinator.start()
        address = wait_for_file(self.address_file, self.coordinator, 30.0)
        self.coordinator.cmd = self._coordinator(address)  # a restart rebinds the same address
        self.address, self.model = address, model
        self.workers = [
            Child(role_of(cmd), [*cmd, *self.keys(key)])
            for cmd, key in zip(  # --autoscale: the first slots' keys
                worker_commands(self.args, address, model), worker_keys(self.args), strict=False
            )
        ]
        self.embedders = [
            Child("prefill", [*cmd, *self.keys(worker_id(cmd))])
            for cmd in embed_commands(self.args, address)
        ]
        self.gateway = Child("gateway", self._gateway(address, api_flags))
        for child in self.children()[1:]:
            child.start()

    def autoscaler(self, model_name: str) -> Autoscaler | None:
        """With ``--autoscale``: the actuator of the planner's plan for ``model_name``, holding
        the workers started so far in its first slots."""
        args = self.args
        if not args.autoscale:
            return None
        url = f"http://{args.host}:{args.port}"
        scaler = Autoscaler(
            self,
            planner_source(url, model_name),
            metrics_source(url),
            max_workers=args.max_workers,
            drain_timeout_s=args.drain_timeout + 10,  # the worker's own drain, then its exit
            period_s=args.autoscale_interval,
        )
        for child in self.workers:
            scaler.adopt(child.role, worker_id(child.cmd), child)
        return scaler

    def start_worker(self, role: str, slot: int, worker_id: str) -> Child:
        """``--autoscale``: a new worker with slot ``slot``'s identity, supervised."""
        cmd = worker_command(self.args, self.address, self.model, role, slot, worker_id)
        child = Child(role, [*cmd, *self.keys(slot_name(slot))])
        child.start()
        self.workers.append(child)
        return child

    def retire(self, proc: Proc) -> None:
        """``--autoscale``: worker ``proc`` is no longer restarted when it exits; SIGTERM: it
        drains."""
        child = next(c for c in self.workers if c is proc)
        self.workers.remove(child)
        self.retiring = [c for c in self.retiring if c.alive()] + [child]
        child.terminate()

    def reload_tenants(self) -> None:
        """SIGHUP: the gateway reads its tenants file again."""
        gateway = self.gateway
        if gateway is not None and gateway.proc is not None and gateway.alive():
            gateway.proc.send_signal(signal.SIGHUP)

    def children(self) -> list[Child]:
        gateway = [self.gateway] if self.gateway else []
        return [self.coordinator, *self.workers, *self.embedders, *gateway]

    def stop(self, drain_timeout: float) -> None:
        if self.gateway is not None:
            self.gateway.stop(drain_timeout + 10)
        workers = [*self.workers, *self.embedders, *self.retiring]
        for child in workers:
            child.terminate()
        for child in workers:
            child.stop(drain_timeout + 10)
        self.coordinator.stop(10)


def _supervise(
    cluster: Cluster,
    args: argparse.Namespace,
    model: str,
    stopping: threading.Event,
    scaler: Autoscaler | None = None,
) -> None:
    """Restart every role that dies until ``stopping``; say once when the gateway is healthy
    (or raise if it is not within ``--ready-timeout``); from then on, ``scaler`` acts."""
    url = f"http://{args.host}:{args.port}"
    ready_by = time.monotonic() + args.ready_timeout
    ready = False
    while not stopping.wait(0.2):
        for child in cluster.children():
            if not child.alive():
                restart(child, args.max_restarts)
        if ready and scaler is not None:
            scaler.tick(time.monotonic())
        if not ready:
            ready = _healthy(url)
            if ready:
                versions = getattr(args, "versions", [])
                served = ", ".join(m for m in [model, *versions, *args.embedding_models] if m)
                print(f"pdserve is serving {served} ({args.mode}) at {url}/v1", flush=True)
            elif time.monotonic() > ready_by:
                raise RuntimeError(f"not healthy within {args.ready_timeout:.0f}s")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            status: int = r.status  # urlopen's result is untyped (typeshed: Any)
            return status == 200
    except OSError:
        return False
