"""``pdserve serve``: every role on this machine, each its own ``pdserve <role>`` process.

    coordinator ◀── workers register ── prefill × P, decode × D   (or colocated × P+D)
         ▲
    gateway (OpenAI API on --port)

Cores are split between the workers (``--threads`` each) and, with ``--pin``, each worker is
pinned to its own cores. Ctrl-C or SIGTERM stops every child; if one dies, all stop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

FORWARDED_ENGINE_FLAGS = (
    "dtype",
    "device",
    "attention_backend",
    "max_model_len",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "seed",
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from engine.cli_args import add_engine_args

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
    g.add_argument("--transfer-backend", default="zmq", choices=["zmq", "host", "ucx"])
    g.add_argument("--pin", action="store_true", help="pin each worker to its own cores")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--ready-timeout", type=float, default=120.0, help="seconds")


def pdserve_command() -> list[str]:
    """The console script beside this Python, so ``ps`` shows ``pdserve <role> ...``."""
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "launch.cli"]


def worker_commands(args: argparse.Namespace, coordinator: str, model: str) -> list[list[str]]:
    """One ``pdserve prefill|decode ...`` command line per worker."""
    num_workers = args.prefill + args.decode
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // num_workers)
    common = [
        f"--model={model}",
        f"--coordinator={coordinator}",
        f"--threads={threads}",
        f"--transfer-backend={args.transfer_backend}",
    ]
    if args.served_model_name:
        common.append(f"--served-model-name={args.served_model_name}")
    for flag in FORWARDED_ENGINE_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            common.append(f"--{flag.replace('_', '-')}={value}")
    if args.no_prefix_caching:
        common.append("--no-prefix-caching")
    pdserve = pdserve_command()
    if args.mode == "colocated":
        roles = [["decode", "--colocated"]] * num_workers
    else:
        roles = [["prefill"]] * args.prefill + [["decode"]] * args.decode
    commands = []
    for i, role in enumerate(roles):
        cmd = [*pdserve, *role, *common, f"--worker-id={role[0]}-{i}"]
        if args.pin:
            first = (i * threads) % cores
            cpus = ",".join(str((first + k) % cores) for k in range(threads))
            cmd = ["taskset", "-c", cpus, *cmd] if shutil.which("taskset") else cmd
        commands.append(cmd)
    return commands


def run_serve(args: argparse.Namespace) -> int:
    from engine.make_model import default_model_dir

    model = args.model or str(default_model_dir("tiny"))
    run_dir = Path(tempfile.mkdtemp(prefix="pdserve-"))
    address_file = run_dir / "coordinator"
    pdserve = pdserve_command()
    children: list[subprocess.Popen] = []
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        children.append(
            subprocess.Popen(
                [
                    *pdserve,
                    "coordinator",
                    "--bind=tcp://127.0.0.1:0",
                    f"--address-file={address_file}",
                ]
            )
        )
        coordinator = _wait_for_file(address_file, children, 30.0)
        for cmd in worker_commands(args, coordinator, model):
            children.append(subprocess.Popen(cmd))
        children.append(
            subprocess.Popen(
                [
                    *pdserve,
                    "gateway",
                    f"--coordinator={coordinator}",
                    f"--host={args.host}",
                    f"--port={args.port}",
                ]
            )
        )
        url = f"http://{args.host}:{args.port}"
        _wait_healthy(url, children, args.ready_timeout, lambda: stopping)
        if not stopping:
            print(f"pdserve is serving {model} ({args.mode}) at {url}/v1", flush=True)
        while not stopping:
            dead = [c for c in children if c.poll() is not None]
            if dead:
                print(
                    f"pdserve serve: {_role(dead[0])} exited ({dead[0].returncode}); stopping",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.2)
        return 0
    except RuntimeError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_all(children)
        shutil.rmtree(run_dir, ignore_errors=True)


def _wait_for_file(path: Path, children: list[subprocess.Popen], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().strip()
        if any(c.poll() is not None for c in children):
            raise RuntimeError("the coordinator exited during start-up")
        time.sleep(0.05)
    raise RuntimeError(f"the coordinator did not start within {timeout:.0f}s")


def _wait_healthy(url: str, children, timeout: float, stopping) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping():
        dead = [c for c in children if c.poll() is not None]
        if dead:
            raise RuntimeError(f"{' '.join(_role(dead[0]))} exited during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    if not stopping():
        raise RuntimeError(f"the cluster was not healthy within {timeout:.0f}s")


def _stop_all(children: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for c in reversed(children):
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()


def _role(child: subprocess.Popen) -> str:
    roles = ("coordinator", "prefill", "decode", "gateway")
    return next((a for a in child.args if a in roles), "a child")
