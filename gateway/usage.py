"""Metering: each finished request's tokens, per tenant and model, kept in memory for
``/metrics`` and in a durable usage record (an SQLite file, ``--usage-db``).

Fed by the gateway's tenancy (``gateway.tenancy``) with each request's response ``usage``.
Two parts:

- ``UsageStore`` owns the SQLite file: its schema, writing a batch in one transaction, and
  reading totals over a time range (``pdserve usage``). WAL mode: a reader never blocks the
  writer and sees whole batches only.
- ``UsageMeter`` is what the request path calls: ``record()`` never blocks. It adds the record
  to the in-memory totals and puts it on a bounded queue; a writer thread takes batches off it
  (up to ``batch_records``, or what came within ``batch_interval_s`` of a batch's first record)
  and hands each to the store. A full queue drops the record from the file (``dropped``, logged
  once per ``log_interval_s``) but not from the in-memory totals, which count what was served.
  ``close()`` writes everything queued before it returns: a clean shutdown loses nothing.

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

import contextlib
import logging
import queue
import sqlite3
import threading
import time
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


_STOP = object()  # wakes the writer at close


class UsageMeter:
    """Takes finished requests' usage without blocking; keeps live totals; writes the file
    through a ``UsageStore`` from one writer thread (module docstring). Without a store (no
    ``--usage-db``) it keeps the live totals only."""

    def __init__(
        self,
        store: UsageStore | None,
        *,
        max_queue: int = 65536,
        batch_records: int = 512,
        batch_interval_s: float = 0.25,
        log_interval_s: float = 10.0,
    ) -> None:
        if max_queue < 1 or batch_records < 1 or batch_interval_s <= 0:
            raise ValueError("max_queue and batch_records must be >= 1, batch_interval_s > 0")
        self.store = store
        self.batch_records = batch_records
        self.batch_interval_s = batch_interval_s
        self.log_interval_s = log_interval_s
        self.dropped = 0  # records the file will not have (queue full, or after close)
        self.write_failures = 0  # records lost to an SQLite error
        self.written = 0
        self._queue: queue.Queue[object] = queue.Queue(max_queue)
        self._lock = threading.Lock()  # live totals, counters, and closed vs put
        self._live: dict[tuple[str, str], UsageTotals] = {}
        self._closed = False
        self._last_drop_log = float("-inf")
        self._dropped_since_log = 0
        self._thread: threading.Thread | None = None
        if store is not None:
            self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
            self._thread.start()

    def record(self, record: UsageRecord) -> bool:
        """Count ``record`` and queue it for the file; False if the file will miss it."""
        with self._lock:
            key = (record.tenant, record.model)
            live = self._live.get(key)
            if live is None:
                live = self._live[key] = UsageTotals(tenant=record.tenant, model=record.model)
            live.add(record)
            if self._thread is None:
                return False
            if not self._closed:
                try:
                    self._queue.put_nowait(record)
                    return True
                except queue.Full:
                    pass
            self._note_drop()
            return False

    def _note_drop(self) -> None:
        self.dropped += 1
        self._dropped_since_log += 1
        now = time.monotonic()
        if now - self._last_drop_log >= self.log_interval_s:
            log.warning(
                "usage record: dropped %d record(s) (queue full or closed; %d in all)",
                self._dropped_since_log,
                self.dropped,
            )
            self._last_drop_log = now
            self._dropped_since_log = 0

    def live_totals(self) -> list[UsageTotals]:
        """Everything recorded since start, per (tenant, model), sorted (for ``/metrics``)."""
        with self._lock:
            return [self._live[key].copy() for key in sorted(self._live)]

    def totals(self, since: datetime, until: datetime | None = None) -> list[UsageTotals]:
        """What the file holds for the range (see ``UsageStore.totals``)."""
        if self.store is None:
            raise UsageDbError("no usage record: this meter keeps live totals only")
        return self.store.totals(since, until)

    def close(self, timeout: float | None = None) -> None:
        """Stop taking records and write every queued one before returning."""
        with self._lock:
            self._closed = True
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):  # full: the writer is busy and sees _closed next
            self._queue.put_nowait(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        assert self.store is not None
        conn = self.store.open_writer()
        try:
            while True:
                batch = self._next_batch()
                if batch:
                    self._write(conn, batch)
                elif self._closed and self._queue.empty():
                    return
        finally:
            conn.close()

    def _next_batch(self) -> list[UsageRecord]:
        """Up to ``batch_records``: wait for a first record, then take what comes until
        ``batch_interval_s`` after it; once closed, take what is queued without waiting."""
        batch: list[UsageRecord] = []
        deadline: float | None = None
        while len(batch) < self.batch_records:
            if self._closed:
                wait = 0.0
            elif deadline is None:
                wait = self.batch_interval_s
            else:
                wait = max(deadline - time.monotonic(), 0.0)
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, UsageRecord):  # else _STOP
                batch.append(item)
                if deadline is None:
                    deadline = time.monotonic() + self.batch_interval_s
        return batch

    def _write(self, conn: sqlite3.Connection, batch: list[UsageRecord]) -> None:
        try:
            self.store.write(conn, batch)
        except sqlite3.Error:
            log.exception("usage record: %d record(s) not written", len(batch))
            with self._lock:
                self.write_failures += len(batch)
            return
        with self._lock:
            self.written += len(batch)
