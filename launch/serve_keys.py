"""The CURVE identities of one ``pdserve serve`` launch: one per process (a worker's key holds
its role, a colocated worker's both), or one per slot with ``--autoscale`` (both worker roles:
a slot turns between prefill and decode), made fresh in the launch's private run directory."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from pdserve.launch.autoscale import slot_name
from pdserve.launch.worker_commands import embed_commands, worker_commands


def launch_keys(
    run_dir: Path, identities: dict[str, frozenset[str]], insecure: bool
) -> Callable[[str], list[str]]:
    """This launch's CURVE keys (one identity per process, name -> its roles, in the private
    run directory): the flags that give process ``name`` its own."""
    if insecure:
        print("pdserve serve: --insecure: internal sockets are open to anyone", file=sys.stderr)
        return lambda name: ["--insecure"]
    from pdserve.launch.keygen import keygen

    keys = keygen(run_dir / "keys", identities)
    return lambda name: [f"--keys={keys}", f"--key-name={name}"]


def identities(args: argparse.Namespace) -> dict[str, frozenset[str]]:
    """Each process's identity and the roles its key holds (what it may send): a worker's
    role's (a colocated worker's both), an autoscaled slot's both worker roles (a slot turns
    between prefill and decode)."""
    from pdserve.launch.versions import ADMIN_KEY
    from pdserve.protocol.roles import (
        ADMIN,
        COORDINATOR,
        GATEWAY,
        PREFILL,
        WORKERS,
        command_roles,
    )

    ids = {"coordinator": frozenset({COORDINATOR}), "gateway": frozenset({GATEWAY})}
    if getattr(args, "versions", None):  # `pdserve rollout`'s (launch/versions.py)
        ids[ADMIN_KEY] = frozenset({ADMIN})
    for cmd in embed_commands(args, ""):  # an embedding model's worker only prefills
        ids[worker_id(cmd)] = frozenset({PREFILL})
    if args.autoscale:
        return ids | {name: WORKERS for name in worker_keys(args)}
    for cmd in worker_commands(args, "", ""):
        ids[worker_id(cmd)] = command_roles(role_of(cmd), colocated="--colocated" in cmd)
    return ids


def worker_keys(args: argparse.Namespace) -> list[str]:
    """The workers' CURVE identities: one per worker, or one per slot with ``--autoscale``."""
    if args.autoscale:
        return [slot_name(i) for i in range(args.max_workers)]
    return [worker_id(c) for c in worker_commands(args, "", "")]


def worker_id(cmd: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in cmd if a.startswith("--worker-id="))


def role_of(cmd: list[str]) -> str:
    roles = ("coordinator", "prefill", "decode", "gateway")
    return next((a for a in cmd if a in roles), "a child")
