"""``pdserve keygen``: a cluster's CURVE keys, one self-contained directory per node, each
identity bound to the roles it runs as (``protocol.roles``: what each role may send).

    pdserve keygen --out keys --nodes nodeA:coordinator+gateway nodeB:prefill nodeC:decode
    # copy keys/nodeB to node B (it holds nodeB's secret key and the cluster's server key),
    # then: PDSERVE_KEYS=/path/to/nodeB launch/prefill.sh ...

Every node names its roles: a key's roles are what receivers let it send, so none is given by
default (``all`` is every role, for a node that runs the whole cluster). A colocated decode
worker needs ``prefill+decode``. ``pdserve serve`` makes its own keys per launch (one identity
per process) with ``keygen``. See ``runtime/security.py`` for the layout.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pdserve.protocol.roles import ALL, ROLES, format_roles, parse_roles
from pdserve.runtime.keyfiles import KeysError, write_identity
from pdserve.runtime.security import AUTHORIZED, SERVER


def add_keygen_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="new directory for the keys")
    parser.add_argument(
        "--nodes",
        nargs="+",
        required=True,
        metavar="NAME:ROLE[+ROLE...]",
        help=f"one identity (and directory OUT/NAME) per node, with the roles it runs as "
        f"({', '.join(ROLES)}; '{ALL}': every one but admin, the operator's for `pdserve "
        "rollout`): its key may send only what those roles send, and a worker id is bound to "
        "the key that registered it",
    )


def run_keygen(args: argparse.Namespace) -> int:
    try:
        nodes = dict(parse_node(spec) for spec in args.nodes)
        if len(nodes) != len(args.nodes):
            raise KeysError(f"keygen needs distinct identity names, got {args.nodes}")
        keygen(args.out, nodes)
        dirs = node_dirs(args.out, list(nodes))
    except (KeysError, OSError) as e:
        print(f"pdserve keygen: {e}", file=sys.stderr)
        return 1
    for d in dirs:
        roles = format_roles(nodes[d.name])
        print(f"{d}: copy to node {d.name} ({roles}), then pass --keys {d} (or PDSERVE_KEYS)")
    return 0


def parse_node(spec: str) -> tuple[str, frozenset[str]]:
    """``nodeB:prefill+decode`` -> (name, roles); ``KeysError`` if the roles are missing or
    unknown."""
    name, sep, roles = spec.partition(":")
    if not sep:
        raise KeysError(
            f"node {spec!r} has no roles: write {spec}:ROLE[+ROLE...] with roles from "
            f"{', '.join(ROLES)} (or {spec}:{ALL}); a key may send only its roles' messages"
        )
    try:
        return name, parse_roles(roles)
    except ValueError as e:
        raise KeysError(f"node {name!r}: {e}") from None


def keygen(out: str | Path, identities: Mapping[str, frozenset[str]]) -> Path:
    """Write a cluster's keys into ``out`` (one directory holding every identity, each with
    its roles); returns it.

    ``out`` is made 0700 and every secret file 0600. Existing keys are never overwritten."""
    names = list(identities)
    if not names:
        raise KeysError("keygen needs at least one identity")
    for name, roles in identities.items():
        if not roles:
            raise KeysError(f"identity {name!r} has no roles")
        if not roles <= set(ROLES):
            raise KeysError(f"identity {name!r}: unknown roles {sorted(roles - set(ROLES))}")
    for name in names:
        if name == SERVER or not name.replace("-", "").replace("_", "").isalnum():
            raise KeysError(f"bad identity name {name!r}: letters, digits, '-' and '_' only")
    root = Path(out)
    if root.exists() and any(root.iterdir()):
        raise KeysError(f"{root} exists and is not empty: keys are never overwritten")
    old = os.umask(0o077)  # nothing secret is ever readable by others, not even briefly
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        (root / AUTHORIZED).mkdir(mode=0o700)
        for name in [SERVER, *names]:
            public, secret = write_identity(root, name, identities.get(name))
            os.chmod(secret, 0o600)
            if name == SERVER:
                os.remove(public)  # the public half is inside server.key_secret too
            else:
                os.replace(public, root / AUTHORIZED / f"{name}.key")
    finally:
        os.umask(old)
    return root


def node_dirs(root: str | Path, names: list[str]) -> list[Path]:
    """Split a ``keygen`` directory into one self-contained ``root/<name>/`` per node: the
    server keypair, every authorized public key, and that node's own identity only."""
    root = Path(root)
    made = []
    old = os.umask(0o077)
    try:
        for name in names:
            node = root / name
            (node / AUTHORIZED).mkdir(mode=0o700, parents=True)
            for src in (root / f"{SERVER}.key_secret", root / f"{name}.key_secret"):
                (node / src.name).write_bytes(src.read_bytes())
            for pub in (root / AUTHORIZED).glob("*.key"):
                (node / AUTHORIZED / pub.name).write_bytes(pub.read_bytes())
            made.append(node)
        for name in [SERVER, *names]:
            os.remove(root / f"{name}.key_secret")  # each now lives in its node's directory
        for pub in (root / AUTHORIZED).glob("*.key"):
            os.remove(pub)
        (root / AUTHORIZED).rmdir()
    finally:
        os.umask(old)
    return made
