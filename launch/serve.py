"""``pdserve serve``: every role on this machine, each its own ``pdserve <role>`` process.

    coordinator ◀── workers register ── prefill × P, decode × D   (or colocated × P+D)
         ▲
    gateway (OpenAI API on --port)

Cores are split between the workers (``--threads`` each) and, with ``--pin``, each worker is
pinned to its own cores. A role that dies is restarted (it re-registers by itself). Ctrl-C or
SIGTERM drains: the gateway finishes its streams, then the workers and the coordinator stop.
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
from pdserve.kvtransfer import backends as transfer_backends
from pdserve.launch.children import Child, restart, wait_for_file
from pdserve.launch.serve_api import add_serve_api_args, gateway_api_flags, served_name

FORWARDED_ENGINE_FLAGS = (
    "dtype",
    "device",
    "attention_backend",
    "cpu_linear",
    "max_model_len",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_step_time",
    "seed",
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from pdserve.engine.cli_args import add_engine_args

    add_engine_args(parser)
    g = parser.add_argument_group("cluster")
    g.add_argument("--prefill", type=int, default=1, help="prefill workers")
    g.add_argument("--decode", type=int, default=1, help="decode workers")
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
    g.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="times a role that dies is restarted before serve gives up",
    )


def pdserve_command() -> list[str]:
    """The console script beside this Python, so ``ps`` shows ``pdserve <role> ...``."""
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pdserve.launch.cli"]


def worker_commands(args: argparse.Namespace, coordinator: str, model: str) -> list[list[str]]:
    """One ``pdserve prefill|decode ...`` command line per worker."""
    num_workers = args.prefill + args.decode
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // num_workers)
    common = [
        f"--drain-timeout={args.drain_timeout}",
        f"--model={model}",
        f"--coordinator={coordinator}",
        f"--threads={threads}",
        f"--transfer-backend={args.transfer_backend}",
        f"--transfer-timeout={args.transfer_timeout}",
    ]
    if served_name(args):
        common.append(f"--served-model-name={served_name(args)}")
    for flag in FORWARDED_ENGINE_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            common.append(f"--{flag.replace('_', '-')}={value}")
    for switch in ("no_prefix_caching", "enforce_eager", "compile"):  # flags without a value
        if getattr(args, switch):
            common.append(f"--{switch.replace('_', '-')}")
    pdserve = pdserve_command()
    if args.mode == "colocated":
        roles = [["decode", "--colocated"]] * num_workers
    else:
        roles = [["prefill"]] * args.prefill + [["decode"]] * args.decode
    commands = []
    for i, role in enumerate(roles):
        cmd = [*pdserve, *role, *common, f"--worker-id={role[0]}-{i}"]
        if role[0] == "prefill" and args.kv_fault:
            cmd.append(f"--kv-fault={args.kv_fault}")
        if role[0] == "prefill" and args.kv_stream_chunks:
            cmd.append("--kv-stream-chunks")
        if role[0] == "decode":
            cmd.append(f"--kv-failure-policy={args.kv_failure_policy}")
        if args.pin:
            first = (i * threads) % cores
            cpus = ",".join(str((first + k) % cores) for k in range(threads))
            cmd = ["taskset", "-c", cpus, *cmd] if shutil.which("taskset") else cmd
        commands.append(cmd)
    return commands


def run_serve(args: argparse.Namespace) -> int:
    from pdserve.models.store import resolve_model
    from pdserve.worker.args import check_stream_chunks

    check_stream_chunks(args, "serve")
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the gateway runs: nothing to reload

    try:  # pulled here, once, so the workers start from the cache
        model = os.path.abspath(resolve_model(args.model, args.dtype))
    except (OSError, RuntimeError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-"))  # 0700
    try:
        api_flags = gateway_api_flags(args, run_dir)
    except ValueError as e:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    roles = ["coordinator", "gateway", *(_worker_id(c) for c in worker_commands(args, "", ""))]
    keys = _keys(run_dir, roles, args.insecure)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    cluster = Cluster(args, keys, run_dir / "coordinator")
    signal.signal(signal.SIGHUP, lambda *_: cluster.reload_tenants())
    try:
        cluster.start(model, api_flags)
        _supervise(cluster, args, model, stopping)
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
        self.workers: list[Child] = []
        self.gateway: Child | None = None

    def _coordinator(self, bind: str, address_file: Path | None = None) -> list[str]:
        cmd = [*self.pdserve, "coordinator", f"--bind={bind}"]
        if address_file is not None:
            cmd.append(f"--address-file={address_file}")
        return [*cmd, *routing_flags(self.args), *self.keys("coordinator")]

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
            *api_flags,
            *self.keys("gateway"),
        ]

    def start(self, model: str, api_flags: list[str]) -> None:
        self.coordinator.start()
        address = wait_for_file(self.address_file, self.coordinator, 30.0)
        self.coordinator.cmd = self._coordinator(address)  # a restart rebinds the same address
        self.workers = [
            Child(_role(cmd), [*cmd, *self.keys(_worker_id(cmd))])
            for cmd in worker_commands(self.args, address, model)
        ]
        self.gateway = Child("gateway", self._gateway(address, api_flags))
        for child in self.children()[1:]:
            child.start()

    def reload_tenants(self) -> None:
        """SIGHUP: the gateway reads its tenants file again."""
        if self.gateway is not None and self.gateway.alive():
            self.gateway.proc.send_signal(signal.SIGHUP)

    def children(self) -> list[Child]:
        return [self.coordinator, *self.workers, *([self.gateway] if self.gateway else [])]

    def stop(self, drain_timeout: float) -> None:
        if self.gateway is not None:
            self.gateway.stop(drain_timeout + 10)
        for child in self.workers:
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)
        for child in self.workers:
            child.stop(drain_timeout + 10)
        self.coordinator.stop(10)


def _supervise(
    cluster: Cluster, args: argparse.Namespace, model: str, stopping: threading.Event
) -> None:
    """Restart every role that dies until ``stopping``; say once when the gateway is healthy
    (or raise if it is not within ``--ready-timeout``)."""
    url = f"http://{args.host}:{args.port}"
    ready_by = time.monotonic() + args.ready_timeout
    ready = False
    while not stopping.wait(0.2):
        for child in cluster.children():
            if not child.alive():
                restart(child, args.max_restarts)
        if not ready:
            ready = _healthy(url)
            if ready:
                print(f"pdserve is serving {model} ({args.mode}) at {url}/v1", flush=True)
            elif time.monotonic() > ready_by:
                raise RuntimeError(f"not healthy within {args.ready_timeout:.0f}s")


def _keys(run_dir: Path, names: list[str], insecure: bool) -> Callable[[str], list[str]]:
    """This launch's CURVE keys (one identity per process, in the private run directory): the
    flags that give process ``name`` its own."""
    if insecure:
        print("pdserve serve: --insecure: internal sockets are open to anyone", file=sys.stderr)
        return lambda name: ["--insecure"]
    from pdserve.launch.keygen import keygen

    keys = keygen(run_dir / "keys", names)
    return lambda name: [f"--keys={keys}", f"--key-name={name}"]


def _worker_id(cmd: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in cmd if a.startswith("--worker-id="))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _role(cmd: list[str]) -> str:
    roles = ("coordinator", "prefill", "decode", "gateway")
    return next((a for a in cmd if a in roles), "a child")
