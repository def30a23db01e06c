"""The usage record (gateway/tenancy/usage.py) and `pdserve usage` (launch/usage.py): exact totals
from the writer thread, close() flushing, drops on a full queue, range edges, a reader beside
the writer (WAL), and the command's table and JSON."""

from __future__ import annotations

import json
import sqlite3
import threading
from contextlib import closing
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from pdserve.gateway.metrics import Outcome
from pdserve.gateway.tenancy.meter import UsageMeter
from pdserve.gateway.tenancy.usage import (
    EPOCH,
    UsageDbError,
    UsageRecord,
    UsageStore,
    UsageTotals,
)
from pdserve.launch.cli import main

T0 = datetime(2026, 11, 1, tzinfo=UTC)
OUTCOMES = list(Outcome)


def rec(i: int, tenant: str = "acme", model: str = "m1", at: datetime = T0) -> UsageRecord:
    return UsageRecord(
        tenant=tenant,
        model=model,
        request_id=f"req-{i}",
        outcome=OUTCOMES[i % len(OUTCOMES)],
        prompt_tokens=10 + i,
        completion_tokens=2 * i,
        cached_tokens=i % 3,
        finished_at=at,
    )


def expected(records: list[UsageRecord]) -> list[UsageTotals]:
    out: dict[tuple[str, str], UsageTotals] = {}
    for r in records:
        out.setdefault((r.tenant, r.model), UsageTotals(tenant=r.tenant, model=r.model)).add(r)
    return [out[k] for k in sorted(out)]


class BlockedStore(UsageStore):
    """Writes wait for ``go``; ``commits`` is the rows in the file after each batch."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.go = threading.Event()
        self.go.set()
        self.entered = threading.Event()
        self.commits: list[int] = []

    def write(self, conn: sqlite3.Connection, batch: list[UsageRecord]) -> None:
        self.entered.set()
        self.go.wait()
        super().write(conn, batch)
        self.commits.append(conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0])


def test_written_totals_equal_records_exactly(tmp_path: Path) -> None:
    records = [
        rec(i, tenant=f"t{i % 3}", model=f"m{i % 2}", at=T0 + timedelta(seconds=i))
        for i in range(1000)
    ]
    meter = UsageMeter(UsageStore(tmp_path / "u.db"), batch_records=64, batch_interval_s=0.01)
    for r in records:
        assert meter.record(r)
    meter.close()
    want = expected(records)
    assert meter.totals(EPOCH) == want
    assert meter.live_totals() == want
    assert (meter.written, meter.dropped, meter.write_failures) == (1000, 0, 0)
    acme = want[0]
    assert (acme.tenant, acme.model, acme.request_count) == ("t0", "m0", 167)
    assert acme.prompt_tokens == sum(10 + i for i in range(0, 1000, 6))
    # a new store on the same file reads the same (schema kept, not recreated)
    assert UsageStore(tmp_path / "u.db").totals(EPOCH) == want


def test_close_flushes_pending_batch(tmp_path: Path) -> None:
    # a batch that would wait an hour for more records is written at close
    meter = UsageMeter(UsageStore(tmp_path / "u.db"), batch_records=10_000, batch_interval_s=3600)
    records = [rec(i) for i in range(7)]
    for r in records:
        meter.record(r)
    meter.close()
    assert not meter._thread.is_alive()
    assert UsageStore(tmp_path / "u.db", create=False).totals(EPOCH) == expected(records)
    assert meter.written == 7
    # after close: counted live, dropped from the file
    assert meter.record(rec(8)) is False
    assert meter.dropped == 1
    assert meter.live_totals() == expected([*records, rec(8)])


def test_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    store = BlockedStore(tmp_path / "u.db")
    store.go.clear()
    meter = UsageMeter(store, max_queue=4, batch_records=1, batch_interval_s=0.01)
    assert meter.record(rec(0))
    assert store.entered.wait(30)  # the writer holds rec(0), stuck in write
    accepted = [meter.record(rec(i)) for i in range(1, 11)]
    assert accepted == [True] * 4 + [False] * 6
    assert meter.dropped == 6
    assert meter.live_totals() == expected([rec(i) for i in range(11)])
    store.go.set()
    meter.close()
    assert store.totals(EPOCH) == expected([rec(i) for i in range(5)])
    assert (meter.written, meter.dropped) == (5, 6)


def test_since_until_edges(tmp_path: Path) -> None:
    us = timedelta(microseconds=1)
    at = [T0 - us, T0, T0 + timedelta(days=1) - us, T0 + timedelta(days=1)]
    records = [rec(i, at=when) for i, when in enumerate(at)]
    store = UsageStore(tmp_path / "u.db")
    with closing(store.open_writer()) as conn:
        store.write(conn, records)

    def count(since: datetime, until: datetime | None = None) -> int:
        return sum(t.request_count for t in store.totals(since, until))

    assert count(T0) == 3  # since is inclusive
    assert count(T0, T0 + timedelta(days=1)) == 2  # until is exclusive
    assert count(T0 + us, T0 + timedelta(days=1)) == 1
    assert count(EPOCH, T0) == 1
    assert count(T0, T0) == 0
    # another zone, same instant
    assert count(T0.astimezone(timezone(timedelta(hours=5)))) == 3
    with pytest.raises(ValueError, match="time zone"):
        store.totals(datetime(2026, 11, 1))


class TakingTurnsStore(BlockedStore):
    """After each commit, waits until the reader has made a read that began after it (so the
    reader sees every batch boundary, however the threads are scheduled)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.turn = threading.Condition()
        self.read_upto = 0  # the reader has read what commits[:read_upto] wrote

    def write(self, conn: sqlite3.Connection, batch: list[UsageRecord]) -> None:
        super().write(conn, batch)
        with self.turn:
            done = self.turn.wait_for(lambda: self.read_upto >= len(self.commits), timeout=30)
        assert done, "the reader stopped"


def test_reader_beside_writer_sees_whole_batches(tmp_path: Path) -> None:
    store = TakingTurnsStore(tmp_path / "u.db")
    conn = sqlite3.connect(tmp_path / "u.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    meter = UsageMeter(store, batch_records=25, batch_interval_s=0.005)
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def read() -> None:
        reader = UsageStore(tmp_path / "u.db", create=False)  # its own connections
        while not stop.is_set():
            upto = len(store.commits)
            rows = reader.totals(EPOCH)
            seen.append((sum(t.request_count for t in rows), sum(t.prompt_tokens for t in rows)))
            with store.turn:
                store.read_upto = upto
                store.turn.notify_all()

    thread = threading.Thread(target=read)
    thread.start()
    records = [UsageRecord(**{**vars(rec(i)), "prompt_tokens": 3}) for i in range(2000)]
    for r in records:
        meter.record(r)
    meter.close()
    stop.set()
    thread.join()
    counts = [n for n, _ in seen]
    assert set(store.commits) <= set(counts) <= {0, *store.commits}  # whole batches only
    assert store.commits[-1] == 2000
    assert all(prompt == 3 * n for n, prompt in seen)
    assert counts == sorted(counts)
    assert store.totals(EPOCH) == expected(records)


def test_record_refuses_bad_fields() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        UsageRecord(**{**vars(rec(0)), "prompt_tokens": -1})
    with pytest.raises(ValueError, match="time zone"):
        UsageRecord(**{**vars(rec(0)), "finished_at": datetime(2026, 11, 1)})
    with pytest.raises(ValueError, match="outcome"):
        UsageRecord(**{**vars(rec(0)), "outcome": "success"})


def test_store_refuses_missing_foreign_and_newer(tmp_path: Path) -> None:
    with pytest.raises(UsageDbError, match="no such usage file"):
        UsageStore(tmp_path / "none.db", create=False)
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE x (a)").connection.close()
    with pytest.raises(UsageDbError, match="not a usage record"):
        UsageStore(other, create=False)
    newer = tmp_path / "newer.db"
    UsageStore(newer)
    with sqlite3.connect(newer) as conn:
        conn.execute("UPDATE schema_version SET version = 99")
    conn.close()
    with pytest.raises(UsageDbError, match="newer"):
        UsageStore(newer)


def _fill(path: Path) -> list[UsageRecord]:
    records = [
        rec(0, "acme", "llama", T0),
        rec(1, "acme", "llama", T0 + timedelta(hours=1)),
        rec(2, "acme", "qwen", T0 + timedelta(days=1)),
        rec(3, "beta", "llama", T0 - timedelta(days=1)),
    ]
    meter = UsageMeter(UsageStore(path))
    for r in records:
        meter.record(r)
    meter.close()
    return records


TOKEN_COLUMNS = ["prompt_tokens", "completion_tokens", "cached_tokens"]
TENANTS = '[tenants.acme]\n[tenants.beta]\n[tenants.idle]\ntier = "batch"\n'


def test_cli_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(tmp_path / "u.db")
    (tmp_path / "t.toml").write_text(TENANTS)
    argv = ["usage", "--usage-db", str(tmp_path / "u.db"), "--tenants", str(tmp_path / "t.toml")]
    assert main([*argv, "--since", "2026-11-01"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        ["tenant", "model", "requests", *(o.value for o in Outcome), *TOKEN_COLUMNS],
        ["acme", "*", "3", "1", "1", "1", "0", "0", "0", "33", "6", "3"],
        ["acme", "llama", "2", "1", "1", "0", "0", "0", "0", "21", "2", "1"],
        ["acme", "qwen", "1", "0", "0", "1", "0", "0", "0", "12", "4", "2"],
        ["beta", "*", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0"],
        ["idle", "*", "0", "0", "0", "0", "0", "0", "0", "0", "0", "0"],
    ]


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = _fill(tmp_path / "u.db")
    argv = ["usage", "--usage-db", str(tmp_path / "u.db"), "--json"]
    assert main([*argv, "--until", "2026-11-02"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["since"] == EPOCH.isoformat()
    assert doc["until"] == "2026-11-02T00:00:00+00:00"
    assert [t["tenant"] for t in doc["tenants"]] == ["acme", "beta"]  # no --tenants: no idle
    acme = doc["tenants"][0]
    assert acme["requests"] == {"total": 2, **dict.fromkeys((o.value for o in Outcome), 0)} | {
        "success": 1,
        "aborted": 1,
    }
    assert (acme["prompt_tokens"], acme["completion_tokens"], acme["cached_tokens"]) == (21, 2, 1)
    assert [m["model"] for m in acme["models"]] == ["llama"]
    # every tenant's totals are the sum of the records' usage over the range
    everything = main(["usage", "--usage-db", str(tmp_path / "u.db"), "--json"])
    assert everything == 0
    tenants = json.loads(capsys.readouterr().out)["tenants"]
    assert sum(t["prompt_tokens"] for t in tenants) == sum(r.prompt_tokens for r in records)
    assert sum(t["requests"]["total"] for t in tenants) == len(records)


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", "--usage-db", str(tmp_path / "none.db")]) == 1
    assert "no such usage file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["usage", "--usage-db", "x", "--since", "November"])
    assert "not a date" in capsys.readouterr().err
