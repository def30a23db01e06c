"""``pdserve keys``: add or revoke a tenant's API keys in a tenants file.

    pdserve keys add acme --tenants tenants.toml      # prints the new key, this once only
    pdserve keys revoke --tenants tenants.toml pdsk-…  # or the hash: sha256:…

A key is ``pdsk-`` and 32 random bytes (``secrets``, URL-safe base64); the file gets its
SHA-256 only (``gateway/tenancy/tenants.py``). ``add`` refuses a tenant the file does not have: its
limits are written by hand first, so no key works under limits nobody chose.

The file is edited as text (``gateway/tenancy/tenants_text.py``): the tenant's ``keys`` array
changes, every other byte stays. The result must load and differ from the file only in that
key; it is written beside the file and moved over it (``os.replace``), with the file's mode and
owner.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import secrets
import sys
import tempfile
from pathlib import Path

from pdserve.gateway.tenancy.tenants import (
    KEY_HASH,
    Tenants,
    TenantsError,
    hash_key,
    parse_tenants,
    read_tenants_text,
)
from pdserve.gateway.tenancy.tenants_text import EditError, add_key_hash, remove_key_hash

KEY_PREFIX = "pdsk-"


def add_keys_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="{add,revoke}")
    add = sub.add_parser("add", help="a new key for TENANT: printed once, its hash stored")
    add.add_argument("tenant", metavar="TENANT", help="a tenant the file already has")
    revoke = sub.add_parser("revoke", help="remove a key (given as itself or as its hash)")
    revoke.add_argument("key", metavar="KEY|sha256:HASH")
    for p in (add, revoke):
        p.add_argument("--tenants", required=True, metavar="FILE", help="the tenants file")


def run_keys(args: argparse.Namespace) -> int:
    try:
        if args.action == "add":
            key = add_key(args.tenants, args.tenant)
            print(key)  # alone on stdout: KEY=$(pdserve keys add ...)
            note = f"a new key of tenant {args.tenant!r} ({hash_key(key)}), shown this once only"
            print(f"pdserve keys: {args.tenants}: {note}", file=sys.stderr)
        else:
            tenant, digest = revoke_key(args.tenants, args.key)
            print(f"pdserve keys: {args.tenants}: revoked {digest} of tenant {tenant!r}")
    except (TenantsError, EditError, OSError) as e:
        print(f"pdserve keys {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def add_key(path: str | Path, tenant: str) -> str:
    """Store a new key's hash in ``tenant``'s keys; returns the key (nowhere else is it)."""
    text = read_tenants_text(path)
    tenants = parse_tenants(text, path)
    if tenant not in tenants:
        known = ", ".join(sorted(tenants.by_name)[:10]) + (", ..." if len(tenants) > 10 else "")
        raise EditError(f"{path}: no tenant {tenant!r} (there are: {known}); add its table first")
    key = new_key()
    digest = hash_key(key)
    _replace(
        path, text, add_key_hash(text, tenant, digest), _with_keys(tenants, tenant, add=digest)
    )
    return key


def revoke_key(path: str | Path, key: str) -> tuple[str, str]:
    """Remove a key (itself, or its ``sha256:`` hash); returns its tenant and its hash."""
    digest = key if KEY_HASH.fullmatch(key) else hash_key(key)
    text = read_tenants_text(path)
    tenants = parse_tenants(text, path)
    holder = tenants.holder(digest)
    if holder is None:  # a key given as itself is never shown back
        raise EditError(f"{path}: no tenant has the key {digest}")
    kept = _with_keys(tenants, holder.name, drop=digest)
    _replace(path, text, remove_key_hash(text, holder.name, digest), kept)
    return holder.name, digest


def _with_keys(tenants: Tenants, name: str, add: str = "", drop: str = "") -> Tenants:
    """``tenants`` with one key added to or dropped from ``name``'s: what an edit must give."""
    tenant = tenants[name]
    hashes = tuple(h for h in tenant.key_hashes if h != drop) + ((add,) if add else ())
    changed = dataclasses.replace(tenant, key_hashes=hashes)
    return Tenants(changed if t.name == name else t for t in tenants)


def _replace(path: str | Path, old: str, new: str, expected: Tenants) -> None:
    """Put ``new`` in place of the file read as ``old``, once it loads as ``expected``."""
    try:
        edited = parse_tenants(new, path)
    except TenantsError as e:
        raise EditError(f"{path}: the edit would not load ({e.reason}); edit it by hand") from e
    if edited != expected:
        raise EditError(f"{path}: the edit would change more than that key; edit it by hand")
    real = Path(os.path.realpath(path))  # a link stays a link to the new file
    st = real.stat()
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(new.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, st.st_mode & 0o7777)
        if os.geteuid() == 0 and (st.st_uid, st.st_gid) != (0, 0):
            os.chown(tmp, st.st_uid, st.st_gid)
        if real.read_bytes() != old.encode("utf-8"):
            raise EditError(f"{path} changed while it was being edited: run the command again")
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _sync_dir(real.parent)


def _sync_dir(directory: Path) -> None:
    """The rename itself on disk (best effort: not every file system opens a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
