"""The thread-safe table of a backend's transfers (request id -> state, deadline, blocks,
secret) and the rules every backend applies to it: which arrival may fill a receiver's
reservation (``Reservations``), whether a sender's queued job still goes (``gate``).

A backend holds a ``TransferTable`` beside its thread (``threads``); its ``poll`` /
``failure_reason`` / ``release`` are the table's, and so is a sender's ``notify``
(``on_finished``)::

    caller thread                                   backend thread
    send / expect: table.add(rid) ──────────────▶   table.advance(rid, TRANSFERRING, DONE...)
    poll(rid) ◀─────────── the table ─────────────  table.expire(): past the deadline, FAILED
"""

from __future__ import annotations

import enum
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.kvtransfer.base import KVPoll, TransferError
from pdserve.kvtransfer.common import check_block_ids
from pdserve.kvtransfer.faults import FaultableJob

log = logging.getLogger("pdserve.kvtransfer")

SECRET_BYTES = 16  # a reservation's transfer secret


@dataclass
class Entry:
    state: KVPoll
    deadline: float
    block_ids: list[int]
    reason: str | None = None
    secret: bytes = b""  # what a sender must present (receivers; see ``Reservations``)


class TransferTable:
    """request id -> state, deadline, reason; shared by a backend's caller and its thread.

    Hold ``lock`` across a check-then-write (the receiver holds it while scattering, so a
    concurrent ``release`` never lets a late transfer write into blocks freed meanwhile).
    """

    def __init__(self, side: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.side = side
        self.clock = clock
        self.lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self.on_finished: Callable[[str, KVPoll], None] | None = None  # see KVSender.notify

    def add(
        self, request_id: str, timeout_s: float, block_ids: Sequence[int], secret: bytes = b""
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"{self.side} {request_id!r}: timeout_s must be > 0")
        with self.lock:
            if request_id in self._entries:
                raise ValueError(f"{self.side}: request id {request_id!r} is already in use")
            deadline = self.clock() + timeout_s
            entry = Entry(KVPoll.PENDING, deadline, list(block_ids), secret=secret)
            self._entries[request_id] = entry

    def extend(self, request_id: str, timeout_s: float, block_ids: Sequence[int]) -> bool:
        """One more part of an unfinished transfer (a sender's): its blocks join the entry's,
        and the lease runs at least ``timeout_s`` from now; False if it is gone or finished."""
        with self.lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.state.finished:
                return False
            entry.block_ids.extend(block_ids)
            entry.deadline = max(entry.deadline, self.clock() + timeout_s)
            return True

    def get(self, request_id: str) -> Entry | None:
        return self._entries.get(request_id)

    def poll(self, request_id: str) -> KVPoll:
        with self.lock:
            entry = self._entries.get(request_id)
            if entry is None:
                raise TransferError(f"{self.side}: unknown request id {request_id!r}")
            self._expire_one(request_id, entry)
            return entry.state

    def reason(self, request_id: str) -> str | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry.reason

    def advance(self, request_id: str, state: KVPoll, reason: str | None = None) -> bool:
        """Move an unfinished transfer to ``state``; False if it is gone or already finished."""
        with self.lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.state.finished:
                return False
            entry.state, entry.reason = state, reason
        if state is KVPoll.FAILED:
            log.warning("%s: transfer %r failed: %s", self.side, request_id, reason)
        callback = self.on_finished
        if state.finished and callback is not None:
            try:
                callback(request_id, state)
            except Exception:  # the owner's bug must not stop the backend's thread
                log.exception("%s: on_finished(%r) failed", self.side, request_id)
        return True

    def expire(self) -> list[str]:
        """Fail every unfinished transfer past its deadline; their request ids."""
        with self.lock:
            return [rid for rid, e in list(self._entries.items()) if self._expire_one(rid, e)]

    def _expire_one(self, request_id: str, entry: Entry) -> bool:
        if entry.state.finished or self.clock() < entry.deadline:
            return False
        return self.advance(request_id, KVPoll.FAILED, "timed out")

    def pop(self, request_id: str) -> Entry | None:
        with self.lock:
            return self._entries.pop(request_id, None)


class Reservations:
    """A receiver's reservations in its table: ``expect`` reserves blocks of the cache under a
    fresh secret; ``claim`` says which reservation an arrival presenting a secret may fill."""

    def __init__(self, table: TransferTable, num_blocks: int) -> None:
        self.table = table
        self.num_blocks = num_blocks

    def expect(self, request_id: str, dst_block_ids: list[int], timeout_s: float) -> bytes:
        check_block_ids(dst_block_ids, self.num_blocks, request_id)
        secret = secrets.token_bytes(SECRET_BYTES)
        self.table.add(request_id, timeout_s, dst_block_ids, secret)
        return secret

    def claim(self, request_id: str, secret: bytes, what: str) -> Entry | None:
        """The entry a sender presenting ``secret`` may fill: expected and nothing arrived yet;
        None otherwise (logged: ``what`` was dropped). The caller holds ``table.lock``."""
        entry, side = self.table.get(request_id), self.table.side
        if entry is None or entry.state is not KVPoll.PENDING:
            state = "unknown" if entry is None else entry.state.value
            log.warning("%s: dropped %s for %s request %r", side, what, state, request_id)
            return None
        if not secret_matches(entry, secret):
            log.warning("%s: dropped %s for %r without its secret", side, what, request_id)
            return None
        return entry


def secret_matches(entry: Entry, presented: bytes) -> bool:
    """Whether a sender presented the transfer's secret (in constant time)."""
    return bool(entry.secret) and hmac.compare_digest(entry.secret, presented)


class JobGate(enum.Enum):
    """What a sender's thread does with a queued job now (``gate``)."""

    OVER = "over"  # released or finished before it left, or dropped by an injected fault
    WAIT = "wait"  # delayed by an injected fault: not yet
    GO = "go"


def gate(table: TransferTable, request_id: str, job: FaultableJob) -> JobGate:
    """Whether a queued job still goes, shared by the threaded senders: a released or
    finished transfer is over; a dropped one is DONE without leaving (the receiver times out);
    a delayed one waits."""
    entry = table.get(request_id)
    if entry is None or entry.state.finished:
        return JobGate.OVER
    if job.fault == "drop":
        log.warning("injected fault: dropping transfer %r", request_id)
        table.advance(request_id, KVPoll.DONE)
        return JobGate.OVER
    return JobGate.WAIT if time.monotonic() < job.not_before else JobGate.GO
