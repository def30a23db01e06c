"""Tenants: who an API key belongs to, and the limits that tenant is held to.

Owns the tenants file's format, its loading and checking, and lookups by presented key
(``tenants_text.py``: where things are written in the file's text). It enforces nothing:
admission and the rate limiter will read a request's ``Tenant``.

    [tenants.acme]
    tier = "standard"             # "premium" > "standard" > "batch"; absent: standard
    requests_per_minute = 600     # absent: no limit
    tokens_per_minute = 200000    # prompt tokens at admission + completion tokens as generated
    max_concurrent = 16           # streams in flight
    max_tokens = 4096             # per request
    weight = 1                    # share within the tier, 0.001 to 1000; absent: 1
    keys = ["sha256:…"]           # hashes only (``pdserve keys add``); absent: none yet

A limit is absent (no limit) or an integer >= 1: 0 is refused, not read as "unlimited" or as
"blocked" (to shut a tenant out, revoke its keys). A file has 1 to 4096 tenants, each up to
1024 keys, in at most 1 MiB. It holds no key itself: a key is looked up by its SHA-256, so
reading the file gives no way in. ``TenantsFile.reload`` (SIGHUP) swaps the whole set at once,
or keeps the old one when the new file is malformed; a stream keeps the ``Tenant`` it was
admitted with.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pdserve.gateway.tenancy.tenants_text import line_of, quoted_key, toml_error_at, top_line
from pdserve.protocol.tenancy import MAX_WEIGHT, MIN_WEIGHT, Tier
from pdserve.protocol.tenancy import TENANT_NAME as NAME

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 1 << 20
MAX_TENANTS = 4096
MAX_KEYS_PER_TENANT = 1024
KEY_HASH = re.compile(r"sha256:[0-9a-f]{64}")
LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "max_tokens")
FIELDS = ("tier", *LIMITS, "weight", "keys")
UNLIMITED = "default"  # the one tenant of --api-key / --api-key-file


def hash_key(key: str | bytes) -> str:
    """What the tenants file stores of an API key: ``sha256:`` + 64 lowercase hex digits."""
    data = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else key
    return "sha256:" + hashlib.sha256(data).hexdigest()


EMPTY_KEY_HASH = hash_key(b"")


class FieldError(ValueError):
    """A tenant that cannot be: which tenant, which field of the file (for its line), why."""

    def __init__(self, tenant: str, field: str | None, reason: str) -> None:
        super().__init__(f"tenant {_show(tenant)}: {reason}")
        self.tenant, self.field, self.reason = tenant, field, reason


class TenantsError(ValueError):
    """A tenants file refused: ``FILE:LINE: reason`` (no line where none can be named)."""

    def __init__(self, path: str | Path, reason: str, line: int | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")
        self.path, self.reason, self.line = str(path), reason, line


def _show(value: object) -> str:
    """A value from the file, as TOML writes it where that matters, cut to 40 characters."""
    text = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Tenant:
    """One tenant and its limits; ``None``: no limit. Checked when made (``FieldError``)."""

    name: str
    tier: Tier = Tier.STANDARD
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None
    weight: float = 1
    key_hashes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            reason = "a tenant's name is 1 to 64 of A-Z a-z 0-9 _ . -"
            raise FieldError(str(self.name), None, reason)
        if not isinstance(self.tier, Tier):
            raise FieldError(self.name, "tier", f"tier must be a Tier, got {_show(self.tier)}")
        for field in LIMITS:
            value = getattr(self, field)
            if value is not None and (type(value) is not int or value < 1):
                reason = f"{field} must be an integer >= 1 (leave it out for no limit)"
                raise FieldError(self.name, field, f"{reason}, got {_show(value)}")
        weight = self.weight
        if type(weight) not in (int, float) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            reason = f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}"
            raise FieldError(self.name, "weight", f"{reason}, got {_show(weight)}")
        self._check_keys()

    def _check_keys(self) -> None:
        if len(self.key_hashes) > MAX_KEYS_PER_TENANT:
            reason = f"more than {MAX_KEYS_PER_TENANT} keys ({len(self.key_hashes)})"
            raise FieldError(self.name, "keys", reason)
        seen: dict[str, int] = {}
        for i, digest in enumerate(self.key_hashes):
            # the value is never shown: a plaintext key pasted here must not reach a log
            if not isinstance(digest, str):
                reason = f"keys[{i}] must be a string, got {type(digest).__name__}"
                raise FieldError(self.name, "keys", reason)
            if not KEY_HASH.fullmatch(digest):
                reason = (
                    f"keys[{i}] is not 'sha256:' and 64 lowercase hex digits (the file holds "
                    "hashes only; `pdserve keys add` writes them)"
                )
                raise FieldError(self.name, "keys", reason)
            if digest == EMPTY_KEY_HASH:
                raise FieldError(self.name, "keys", f"keys[{i}] is the hash of an empty key")
            first = seen.setdefault(digest, i)
            if first != i:
                raise FieldError(self.name, "keys", f"keys[{i}] repeats keys[{first}]")


class Tenants:
    """Every tenant by name, and by the hash of each of its keys."""

    def __init__(self, tenants: Iterable[Tenant]) -> None:
        by_name: dict[str, Tenant] = {}
        by_hash: dict[str, Tenant] = {}
        for tenant in tenants:
            if tenant.name in by_name:
                raise FieldError(tenant.name, None, "defined twice")
            by_name[tenant.name] = tenant
            for i, digest in enumerate(tenant.key_hashes):
                other = by_hash.setdefault(digest, tenant)
                if other is not tenant:
                    reason = f"keys[{i}] is a key of tenant {other.name!r} too"
                    raise FieldError(tenant.name, "keys", reason)
        if len(by_name) > MAX_TENANTS:
            raise ValueError(f"more than {MAX_TENANTS} tenants ({len(by_name)})")
        self.by_name: Mapping[str, Tenant] = MappingProxyType(by_name)
        self._by_hash = by_hash

    @classmethod
    def unlimited(cls, api_keys: Sequence[str]) -> Tenants:
        """Today's ``--api-key`` / ``--api-key-file`` keys as one tenant with no limits."""
        hashes = tuple(dict.fromkeys(hash_key(key) for key in api_keys))
        return cls([Tenant(name=UNLIMITED, key_hashes=hashes)])

    def lookup(self, api_key: str | bytes) -> Tenant | None:
        """The tenant holding ``api_key``, or None (401).

        Only the key's SHA-256 meets the table: a lookup's timing can tell something of that
        hash, which says nothing of any stored key, so no constant-time compare is needed."""
        return self._by_hash.get(hash_key(api_key)) if api_key else None

    def holder(self, key_hash: str) -> Tenant | None:
        """The tenant a stored hash belongs to (``pdserve keys revoke``)."""
        return self._by_hash.get(key_hash)

    def __getitem__(self, name: str) -> Tenant:
        return self.by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tenants) and dict(self.by_name) == dict(other.by_name)

    @property
    def key_count(self) -> int:
        return len(self._by_hash)


def load_tenants(path: str | Path) -> Tenants:
    """Read and check a tenants file; ``TenantsError`` names the file, the line, the reason."""
    return parse_tenants(read_tenants_text(path), path)


def read_tenants_text(path: str | Path) -> str:
    """A tenants file's text, at most ``MAX_FILE_BYTES`` of UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise TenantsError(path, f"cannot read it: {e.strerror or e}") from e
    if len(data) > MAX_FILE_BYTES:
        raise TenantsError(path, f"larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise TenantsError(path, f"not UTF-8 (at byte offset {e.start})", line) from e
    return text


def parse_tenants(text: str, path: str | Path) -> Tenants:
    """A tenants file's text, checked as ``load_tenants`` does (``path`` names it in errors)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        reason, line = toml_error_at(str(e), text)
        raise TenantsError(path, f"not valid TOML: {reason}", line) from e
    unknown = [name for name in doc if name != "tenants"]
    if unknown:
        reason = f"unknown top-level field {unknown[0]!r}: only [tenants.NAME] tables"
        raise TenantsError(path, reason, top_line(text, rf"{quoted_key(unknown[0])}[ \t]*[=.\]]"))
    tables = doc.get("tenants")
    line = top_line(text, r"tenants[ \t]*[=\]]")
    if not isinstance(tables, dict):
        found = "no [tenants] table" if tables is None else "tenants is not a table"
        raise TenantsError(path, f"{found}: write each tenant as [tenants.NAME]", line)
    if not tables:
        raise TenantsError(path, "no tenant: add a [tenants.NAME] table", line)
    if len(tables) > MAX_TENANTS:
        raise TenantsError(path, f"more than {MAX_TENANTS} tenants ({len(tables)})")
    try:
        return Tenants(_tenant(name, table) for name, table in tables.items())
    except FieldError as e:
        raise TenantsError(path, str(e), line_of(text, e.tenant, e.field)) from e


def _tenant(name: str, table: object) -> Tenant:
    """A ``[tenants.NAME]`` table's raw TOML values to a Tenant (which checks the values)."""
    if not NAME.fullmatch(name):
        Tenant(name=name)  # raises the name's error
    if not isinstance(table, dict):
        raise FieldError(name, None, f"must be a table of fields, got {_show(table)}")
    for field in table:
        if field not in FIELDS:
            known = ", ".join(FIELDS)
            raise FieldError(name, field, f"unknown field {field!r} (known: {known})")
    values: dict[str, Any] = {k: v for k, v in table.items() if k not in ("tier", "keys")}
    if "tier" in table:
        tier = table["tier"]
        if not isinstance(tier, str) or tier not in {t.value for t in Tier}:
            reason = f"tier must be one of premium, standard, batch, got {_show(tier)}"
            raise FieldError(name, "tier", reason)
        values["tier"] = Tier(tier)
    if "keys" in table:
        keys = table["keys"]
        if not isinstance(keys, list):
            reason = f"keys must be an array of strings, got a {type(keys).__name__}"
            raise FieldError(name, "keys", reason)
        values["key_hashes"] = tuple(keys)
    return Tenant(name=name, **values)


class TenantsFile:
    """The tenants in force and the file they come from: ``reload()`` is what SIGHUP calls.

    A malformed file at start raises ``TenantsError``; at a reload it is logged and returned,
    and the tenants in force stay. Admitted requests hold their own ``Tenant``: nothing they
    hold changes at a reload, so no stream is dropped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tenants = load_tenants(self.path)

    def reload(self) -> TenantsError | None:
        """Read the file again: the new tenants (None), or the refusal, with the old kept."""
        try:
            tenants = load_tenants(self.path)
        except TenantsError as e:
            log.error("tenants file refused, the previous one stays in force: %s", e)
            return e
        self.tenants = tenants
        log.info(
            "tenants reloaded from %s: %d, %d keys", self.path, len(tenants), tenants.key_count
        )
        return None
