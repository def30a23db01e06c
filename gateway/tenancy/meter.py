"""The request path's side of metering (``UsageMeter``): ``record()`` never blocks; live totals
per (tenant, model) for ``/metrics``; a writer thread hands batches to the usage record
(``usage.py``: the SQLite file, its schema and queries), when there is one."""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import threading
import time
from datetime import datetime

from pdserve.gateway.tenancy.usage import UsageDbError, UsageRecord, UsageStore, UsageTotals

log = logging.getLogger(__name__)

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
            self._thread = threading.Thread(
                target=self._run, args=(store,), name="usage-writer", daemon=True
            )
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

    def _run(self, store: UsageStore) -> None:
        conn = store.open_writer()
        try:
            while True:
                batch = self._next_batch()
                if batch:
                    self._write(store, conn, batch)
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

    def _write(self, store: UsageStore, conn: sqlite3.Connection, batch: list[UsageRecord]) -> None:
        try:
            store.write(conn, batch)
        except sqlite3.Error:
            log.exception("usage record: %d record(s) not written", len(batch))
            with self._lock:
                self.write_failures += len(batch)
            return
        with self._lock:
            self.written += len(batch)
