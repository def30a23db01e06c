"""The thread-safe table of a backend's transfers (request id -> state, deadline, blocks,
secret) and what every backend builds on it: ``poll`` / ``failure_reason`` / ``release`` /
``notify`` (``TableBacked``); for receivers, ``expect`` and the background thread
(``TableBackedReceiver``); for the threaded senders, the job queue and the background thread
(``TableBackedSender``)::

    caller thread                                   backend thread (``_run``)
    send: table.add(rid) ─ _enqueue(job) ─wake─▶     _take_jobs() ... table.advance(rid, state)
    poll(rid) ◀─────────── the table ─────────────  expire() past the deadline: FAILED
"""

from __future__ import annotations

import enum
import hmac
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from pdserve.kvtransfer.base import DEFAULT_TIMEOUT_S, KVPoll, TransferError
from pdserve.kvtransfer.common import check_block_ids
from pdserve.kvtransfer.faults import FaultableJob, FaultDice, FaultPlan

log = logging.getLogger("pdserve.kvtransfer")

SECRET_BYTES = 16  # a reservation's transfer secret


@dataclass
class Entry:
    state: KVPoll
    deadline: float
    block_ids: list[int]
    reason: str | None = None
    secret: bytes = b""  # what a sender must present (receivers; see ``expect``)


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


class TableBacked:
    """``poll`` / ``failure_reason`` / ``release`` of a backend that keeps a ``TransferTable``."""

    _table: TransferTable

    def poll(self, request_id: str) -> KVPoll:
        return self._table.poll(request_id)

    def failure_reason(self, request_id: str) -> str | None:
        return self._table.reason(request_id)

    def release(self, request_id: str) -> None:
        self._table.pop(request_id)

    def notify(self, callback: Callable[[str, KVPoll], None] | None) -> None:
        self._table.on_finished = callback


class TableBackedReceiver(TableBacked):
    """What every receiver shares: its table, its cache, ``expect``, and one background thread
    running ``_run`` until ``close``. A backend calls ``_init_receiver`` first in ``__init__``
    and ``_start_thread`` last, once it knows its address."""

    _num_blocks: int

    def _init_receiver(
        self, backend: str, kv_layers: list[torch.Tensor], require_checksum: bool
    ) -> None:
        self._layers = kv_layers
        self._num_blocks = kv_layers[0].shape[0]
        self.require_checksum = require_checksum
        self._table = TransferTable(f"{backend} receiver")

    def _start_thread(self, backend: str, address: str) -> None:
        self._address = address
        self._stop = threading.Event()
        name = f"kv-{backend}-receiver"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def _stop_thread(self) -> bool:
        """Stop and join the thread; False if that was done already (``close`` is idempotent)."""
        if self._stop.is_set():
            return False
        self._stop.set()
        self._thread.join()
        return True

    @property
    def address(self) -> str:
        return self._address

    def expect(
        self, request_id: str, dst_block_ids: list[int], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> bytes:
        check_block_ids(dst_block_ids, self._num_blocks, request_id)
        secret = secrets.token_bytes(SECRET_BYTES)
        self._table.add(request_id, timeout_s, dst_block_ids, secret)
        return secret

    def _pending(self, request_id: str, secret: bytes, what: str) -> Entry | None:
        """The entry a sender presenting ``secret`` may fill: expected and nothing arrived yet;
        None otherwise (logged: ``what`` was dropped). The caller holds ``_table.lock``."""
        entry, side = self._table.get(request_id), self._table.side
        if entry is None or entry.state is not KVPoll.PENDING:
            state = "unknown" if entry is None else entry.state.value
            log.warning("%s: dropped %s for %s request %r", side, what, state, request_id)
            return None
        if not secret_matches(entry, secret):
            log.warning("%s: dropped %s for %r without its secret", side, what, request_id)
            return None
        return entry


class JobGate(enum.Enum):
    """What a sender's thread does with a queued job now (``gate``)."""

    OVER = "over"  # released or finished before it left, or dropped by an injected fault
    WAIT = "wait"  # delayed by an injected fault: not yet
    GO = "go"


def gate(table: TransferTable, request_id: str, job: FaultableJob) -> JobGate:
    """Whether a queued job still goes, shared by every threaded sender: a released or
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


class TableBackedSender(TableBacked):
    """What every threaded sender shares: its table, a queue of jobs the caller fills
    (``_enqueue``: an injected fault is decided then), and one background thread running
    ``_run`` until ``close``, woken through a socketpair. A backend sets ``_table`` and calls
    ``_start_thread`` last in ``__init__``."""

    def _start_thread(self, name: str, ctx: zmq.Context | None, fault: FaultPlan | None) -> None:
        self._dice = FaultDice(fault) if fault is not None else None
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def _enqueue(self, job: FaultableJob) -> None:
        """Hand a job to the sender thread, marking it with this transfer's fault, if any."""
        if self._dice is not None:
            self._dice.mark(job)
        self._jobs.put(job)
        self._wake_w.send(b"\0")

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _take_jobs(self) -> list[Any]:
        jobs = []
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                return jobs

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_w.send(b"\0")
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()
        if self._own_ctx:
            self._ctx.term()


def secret_matches(entry: Entry, presented: bytes) -> bool:
    """Whether a sender presented the transfer's secret (in constant time)."""
    return bool(entry.secret) and hmac.compare_digest(entry.secret, presented)
