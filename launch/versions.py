"""``pdserve serve`` with versions of a model behind one name::

    pdserve serve --model chat@v1=DIR1 --model chat@v2=DIR2 --canary chat@v2=5% [--canary-gate]

Each version is a served model of its own: its own prefill and decode pools (``--prefill`` and
``--decode`` workers each, registered as ``chat@v1``; worker ids ``<version>-<role>-<i>``), the
cores and KV memory split between every version's workers. The first version of a name is
its stable one; the coordinator holds the weights (``coordinator.rollouts``), the gateway
picks a version per conversation (``gateway.versions``), and ``pdserve rollout`` changes the
weights through the launch's ``admin`` key. The workers of a version other than the stable
one are expendable: one that keeps dying (a broken canary) is restarted with a growing pause
for as long as serve runs, never taking the stable version down with it.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdserve.launch.children import Child
from pdserve.protocol.rollouts import split_version

ADMIN_KEY = "admin"  # the launch's identity for `pdserve rollout`


@dataclass(frozen=True)
class Version:
    name: str
    version: str
    path: str  # its model directory

    @property
    def served(self) -> str:
        return f"{self.name}@{self.version}"

    @property
    def tag(self) -> str:
        """Its workers' id prefix (a key name: letters, digits, '-', '_')."""
        return self.version.replace(".", "_")


def take_versions(args: argparse.Namespace, resolve: Callable[[str], str]) -> list[Version]:
    """The ``--model NAME@VERSION=DIR`` values (``resolve``: a value to its directory), taken
    out of ``args.model``, which keeps the others; also ``args.versions`` (their served
    names). ``ValueError`` for what serve cannot run."""
    versions, others = [], []
    for spec in args.model or []:
        served, sep, path = spec.partition("=")
        parts = split_version(served) if sep else None
        if parts is None:
            others.append(spec)
            continue
        versions.append(Version(parts[0], parts[1], os.path.abspath(resolve(path))))
    args.model = others
    args.version_specs = versions
    args.versions = [v.served for v in versions]  # the coordinator's --model flags
    if not versions:
        return []
    if len({v.served for v in versions}) != len(versions):
        raise ValueError("--model: a version is given twice")
    if len({(v.name, v.tag) for v in versions}) != len(versions):
        raise ValueError("--model: two versions of one name differ only in '.' and '_'")
    if args.served_model_name:
        raise ValueError("--served-model-name: versions are served as NAME@VERSION already")
    if args.autoscale:
        raise ValueError("--autoscale sizes one model's pools, not each version's")
    return versions


def version_commands(
    args: argparse.Namespace,
    coordinator: str,
    worker_command: Callable[..., list[str]],
    total_ranks: int,
) -> list[list[str]]:
    """Every version's workers' command lines (``worker_command``: one worker's, as for one
    model), the cores (``--threads``) and the KV cache's memory share split between all."""
    versions: list[Version] = args.version_specs
    count = len(versions)
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    if args.mode == "colocated":
        roles = ["decode"] * len(roles)
    each = copy.copy(args)
    each.threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, total_ranks * count))
    cmds = []
    for k, v in enumerate(versions):
        each.served_model_name = [v.served]
        for i, role in enumerate(roles):
            slot = k * len(roles) + i
            cmd = worker_command(each, coordinator, v.path, role, slot, f"{v.tag}-{role}-{i}")
            cmds.append([_shared(flag, count) for flag in cmd])
    return cmds


def _shared(flag: str, count: int) -> str:
    """A worker's ``--kv-cache-share`` divided between the versions' workers."""
    name, sep, value = flag.partition("=")
    if name != "--kv-cache-share" or not sep or count == 1:
        return flag
    return f"{name}={float(value) / count:.4g}"


def mark_expendable(workers: list[Child], args: argparse.Namespace) -> None:
    """The workers of every version but each name's stable (first) one: a canary that keeps
    failing is restarted with a pause, never fatal to serve (``launch.children.restart``)."""
    versions: list[Version] = getattr(args, "version_specs", [])
    stable: dict[str, str] = {}
    for v in versions:
        stable.setdefault(v.name, v.served)
    canaries = {v.tag for v in versions if stable[v.name] != v.served}
    for child in workers:
        worker = next((a.split("=", 1)[1] for a in child.cmd if a.startswith("--worker-id=")), "")
        child.expendable = worker.rsplit("-", 2)[0] in canaries  # <tag>-<role>-<i>


def rollout_hint(coordinator: str, keys_dir: Path | None) -> str:
    """What serve prints for ``pdserve rollout`` to reach this launch's coordinator."""
    keys = f"--keys={keys_dir} --key-name={ADMIN_KEY}" if keys_dir else "--insecure"
    return f"pdserve rollout --coordinator={coordinator} {keys} status"
