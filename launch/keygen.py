"""``pdserve keygen``: a cluster's CURVE keys, one self-contained directory per node.

    pdserve keygen --out keys --nodes nodeA nodeB nodeC
    # copy keys/nodeB to node B (it holds nodeB's secret key and the cluster's server key),
    # then: PDSERVE_KEYS=/path/to/nodeB launch/prefill.sh ...

``pdserve serve`` makes its own keys per launch (one identity per process) with ``keygen``.
See ``runtime/security.py`` for the layout.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from zmq.auth import create_certificates

from pdserve.runtime.security import AUTHORIZED, SERVER, KeysError


def add_keygen_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="new directory for the keys")
    parser.add_argument(
        "--nodes",
        nargs="+",
        default=["node"],
        metavar="NAME",
        help="one identity (and directory OUT/NAME) per node; a worker id is bound to the key "
        "that registered it",
    )


def run_keygen(args: argparse.Namespace) -> int:
    try:
        keygen(args.out, args.nodes)
        dirs = node_dirs(args.out, args.nodes)
    except (KeysError, OSError) as e:
        print(f"pdserve keygen: {e}", file=sys.stderr)
        return 1
    for d in dirs:
        print(f"{d}: copy to node {d.name}, then pass --keys {d} (or PDSERVE_KEYS)")
    return 0


def keygen(out: str | Path, names: list[str]) -> Path:
    """Write a cluster's keys into ``out`` (one directory holding every identity); returns it.

    ``out`` is made 0700 and every secret file 0600. Existing keys are never overwritten."""
    if not names or len(set(names)) != len(names):
        raise KeysError(f"keygen needs distinct identity names, got {names}")
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
            public, secret = create_certificates(root, name)
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
