"""An identity's key files, with the roles it holds (``protocol.roles``).

A zmq certificate is text: a ``metadata`` section of ``key = value`` lines, then a ``curve``
section with the keys. pdserve keeps each identity's roles in its metadata, in the secret file
and in the public one under ``authorized/``, which is what receivers go by::

    metadata
        roles = prefill+decode
    curve
        public-key = "..."

pyzmq's ``create_certificates`` writes metadata into the secret file only and
``load_certificate`` reads none, so the public half is written and the metadata read here.
"""

from __future__ import annotations

from pathlib import Path

from zmq.auth import create_certificates, load_certificate

from pdserve.protocol.roles import ROLES, format_roles, parse_roles

ROLES_KEY = "roles"
_PUBLIC = """#   pdserve identity {name}: its public key and roles (make them with `pdserve keygen`)

metadata
    {key} = {roles}
curve
    public-key = "{public}"
"""


class KeysError(ValueError):
    """Keys that are missing, unreadable, not private enough or bound to no role."""


def write_identity(directory: Path, name: str, roles: frozenset[str] | None) -> tuple[Path, Path]:
    """A new keypair ``directory/name.key`` (public) and ``.key_secret``, both naming
    ``roles`` (None: the cluster's server keypair, which no sender presents)."""
    metadata = None if roles is None else {ROLES_KEY: format_roles(roles)}
    public_file, secret_file = create_certificates(directory, name, metadata=metadata)
    if roles is not None:
        public = load_certificate(public_file)[0].decode()
        text = _PUBLIC.format(name=name, key=ROLES_KEY, roles=format_roles(roles), public=public)
        Path(public_file).write_text(text, encoding="utf-8")
    return Path(public_file), Path(secret_file)


def metadata(path: Path) -> dict[str, str]:
    """The ``key = value`` lines of a certificate's ``metadata`` section."""
    out: dict[str, str] = {}
    section = ""
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            section = line.strip()
        elif section == "metadata" and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip("\"'")
    return out


def read_roles(path: Path) -> frozenset[str]:
    """The roles a key file names; ``KeysError`` when it names none (keys made before
    identities had roles) or one that does not exist."""
    text = metadata(path).get(ROLES_KEY)
    if text is None:
        raise KeysError(
            f"{path} names no roles: it was made before keys were bound to roles, and would let "
            f"its holder send any role's messages. Make the cluster's keys again: pdserve "
            f"keygen --out DIR --nodes NAME:ROLE[+ROLE...] ... (roles: {', '.join(ROLES)})"
        )
    try:
        return parse_roles(text)
    except ValueError as e:
        raise KeysError(f"{path}: {e}") from None


def load_authorized(directory: Path) -> dict[bytes, frozenset[str]]:
    """Public key (z85) -> roles, of every identity ``directory`` (``authorized/``) admits."""
    out: dict[bytes, frozenset[str]] = {}
    for path in sorted(directory.glob("*.key")):
        public, _ = load_certificate(path)
        out[public] = read_roles(path)
    return out


def load_secret(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) of an identity's secret file, which only its owner may read."""
    if not path.is_file():
        raise KeysError(f"missing key file {path}")
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise KeysError(f"{path} is readable by others (mode {mode:o}): chmod 600 it")
    public, secret = load_certificate(path)
    if secret is None:
        raise KeysError(f"{path} holds no secret key")
    return public, secret
