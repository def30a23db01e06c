"""Metering: each finished request's tokens, per tenant and model, kept in memory for
``/metrics`` and in a durable usage record (an SQLite file, ``--usage-db``).

Fed by the gateway's tenancy (``tenancy.core``) with each request's response ``usage``.
Two parts:

- ``UsageStore`` owns the SQLite file: its schema, writing a batch in one transaction, and
  reading totals over a time range (``pdserve usage``). WAL mode: a reader never blocks the
  writer and sees whole batches only.
- ``UsageMeter`` (``meter.py``) is what the request path calls: ``record()`` never
  blocks. It adds the record to the in-memory totals and puts it on a bounded queue; a writer
  thread takes batches off it (up to ``batch_records``, or what came within
  ``batch_interval_s`` of a batch's first record) and hands each to the store. A full queue
  drops the record from the file (``dropped``, logged once per ``log_interval_s``) but not
  from the in-memory totals, which count what was served. ``close()`` writes everything
  queued before it returns: a clean shutdown loses nothing.

    request path --record()--> [queue, bounded] --writer thread--> UsageStore --> usage.db
                  \\--> in-memory totals (/metrics)

Schema (version 1); ``finished_at`` is microseconds since the epoch, UTC; a range is
``since <= finished_at < until``:

    schema_version(version INTEGER)
    usage(id INTEGER PRIMARY KEY, finished_at INTEGER, tenant TEXT, model TEXT,
          request_id TEXT, outcome TEXT, prompt_tokens INTEGER, completion_tokens INTEGER,
          cached_tokens INTEGER)            -- index usage_finished_at(finished_at)
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from pdserve.gateway.metrics import Outcome

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY,
    finished_at INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    model TEXT NOT NULL,
    request_id TEXT NOT NULL,
    outcome TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_finished_at ON usage (finished_at);
"""
_INSERT = (
    "INSERT INTO usage (finished_at, tenant, model, request_id, outcome, prompt_tokens,"
    " completion_tokens, cached_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_TOTALS = (
    "SELECT tenant, model, outcome, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens),"
    " SUM(cached_tokens) FROM usage WHERE finished_at >= ? AND finished_at < ?"
    " GROUP BY tenant, model, outcome"
)
_END_OF_TIME = 1 << 62


class UsageDbError(RuntimeError):
    """The usage file is missing, not a usage record, or of a newer schema."""


def to_micros(when: datetime) -> int:
    """Microseconds since the epoch, exactly; ``when`` must carry its time zone."""
    if when.tzinfo is None:
        raise ValueError(f"a usage time needs a time zone (UTC), got naive {when.isoformat()}")
    return (when - EPOCH) // _US


@dataclass(frozen=True)
class UsageRecord:
    """One finished request's usage, as its response's ``usage`` reports it."""

    tenant: str
    model: str
    request_id: str
    outcome: Outcome
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finished_at: datetime  # UTC

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.outcome, Outcome):
            raise ValueError(f"outcome must be an Outcome, got {self.outcome!r}")
        to_micros(self.finished_at)  # refuses a naive time


@dataclass
class UsageTotals:
    """A (tenant, model)'s sums: requests by outcome, and tokens over every outcome."""

    tenant: str
    model: str
    requests: dict[Outcome, int] = field(default_factory=lambda: dict.fromkeys(Outcome, 0))
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def request_count(self) -> int:
        return sum(self.requests.values())

    def add(self, record: UsageRecord) -> None:
        self.requests[record.outcome] += 1
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens
        self.cached_tokens += record.cached_tokens

    def copy(self) -> UsageTotals:
        return UsageTotals(
            tenant=self.tenant,
            model=self.model,
            requests=dict(self.requests),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
        )


class UsageStore:
    """The usage file: schema, batched writes, totals over a range. Each call opens its own
    connection, so the writer thread and any reader (another process too) never share one."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise UsageDbError(f"{self.path}: no such usage file")
        with self._connect() as conn:
            if create:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript(_SCHEMA)
                if conn.execute("SELECT COUNT(*) FROM schema_version").fetchone()[0] == 0:
                    conn.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            self._check_version(conn)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30.0)
        conn.execute("PRAGMA busy_timeout=30000")
        return conn

    def _check_version(self, conn: sqlite3.Connection) -> None:
        try:
            row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
        except sqlite3.DatabaseError as e:
            raise UsageDbError(f"{self.path}: not a usage record ({e})") from e
        if row is None or row[0] is None:
            raise UsageDbError(f"{self.path}: not a usage record (no schema version)")
        if row[0] > SCHEMA_VERSION:
            reason = f"schema version {row[0]} is newer than this pdserve's {SCHEMA_VERSION}"
            raise UsageDbError(f"{self.path}: {reason}")

    def open_writer(self) -> sqlite3.Connection:
        """A connection for ``write``, made in the thread that will use it."""
        conn = self._connect()
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never torn
        return conn

    def write(self, conn: sqlite3.Connection, batch: list[UsageRecord]) -> None:
        """Append ``batch`` in one transaction: a reader sees all of it or none."""
        rows = [
            (
                to_micros(r.finished_at),
                r.tenant,
                r.model,
                r.request_id,
                r.outcome.value,
                r.prompt_tokens,
                r.completion_tokens,
                r.cached_tokens,
            )
            for r in batch
        ]
        with conn:
            conn.executemany(_INSERT, rows)

    def totals(self, since: datetime, until: datetime | None = None) -> list[UsageTotals]:
        """Per (tenant, model), sorted, for ``since <= finished_at < until`` (None: no end)."""
        end = _END_OF_TIME if until is None else to_micros(until)
        conn = self._connect()
        try:
            rows = conn.execute(_TOTALS, (to_micros(since), end)).fetchall()
        finally:
            conn.close()
        out: dict[tuple[str, str], UsageTotals] = {}
        for tenant, model, outcome, count, prompt, completion, cached in rows:
            t = out.setdefault((tenant, model), UsageTotals(tenant=tenant, model=model))
            t.requests[Outcome(outcome)] += count
            t.prompt_tokens += prompt
            t.completion_tokens += completion
            t.cached_tokens += cached
        return [out[key] for key in sorted(out)]
