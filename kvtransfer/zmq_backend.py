"""Host-memory KV transfer over ZeroMQ (PUSH → PULL), the backend every CPU test uses.

One transfer is one multipart message::

    frame 0      KVHeader (protocol codec): request id, dst block ids, layers, dtype, checksum
    frame 1+l    layer l: the gathered source blocks, [n, 2, block_size, H, D] raw bytes

The sender gathers on the caller's thread (after ``send`` returns the source blocks may be
overwritten) and hands the frames to zmq zero-copy from its own thread once a connection to
the receiver is up (IMMEDIATE), retrying until the timeout; it is DONE when zmq has released
every frame. The receiver's thread checks the header against its cache and the expected
request, then scatters straight from zmq's frames.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from pdserve.kvtransfer import common
from pdserve.kvtransfer.base import (
    DEFAULT_TIMEOUT_S,
    KVPoll,
    KVReceiver,
    KVSender,
    TransferError,
    TransferSpec,
)
from pdserve.kvtransfer.faults import FaultDice, FaultPlan
from pdserve.kvtransfer.table import JobGate, Reservations, TransferTable, gate
from pdserve.kvtransfer.threads import LoopThread, SenderThread
from pdserve.protocol.messages import KVHeader, ProtocolError, decode, encode
from pdserve.protocol.roles import Receiver
from pdserve.runtime.gate import RoleGate
from pdserve.runtime.security import security_of
from pdserve.runtime.sockets import bound_address, make_socket, sender_of

log = logging.getLogger("pdserve.kvtransfer.zmq")

DEFAULT_BIND = "tcp://127.0.0.1:0"
_IDLE_POLL_MS = 50
_BUSY_POLL_MS = 1


@dataclass
class _Job:
    spec: TransferSpec
    staged: list[torch.Tensor]  # one [n, 2, bs, H, D] tensor per layer
    frames: list[bytes | memoryview] | None = None  # header + zero-copy ``staged``, built once
    fault: str | None = None  # injected fault for this transfer (kvtransfer.faults)
    not_before: float = 0.0  # monotonic time it may leave (delay fault)


class ZmqKVSender(KVSender):
    """Parts: ``_table`` (the transfers), ``_thread`` (the sender thread and its queue),
    ``_dice`` (the injected fault, if any); a socket per receiver, on the thread."""

    def __init__(
        self,
        *,
        checksum: bool = False,
        ctx: zmq.SyncContext | None = None,
        fault: FaultPlan | None = None,
    ) -> None:
        self.checksum = checksum
        self._table = TransferTable("zmq sender")
        self._dice = FaultDice(fault) if fault is not None else None
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self._thread: SenderThread[_Job] = SenderThread("kv-zmq-sender")
        self._thread.start(self._run)

    def send(self, spec: TransferSpec, kv_layers: list[torch.Tensor]) -> None:
        if not self._thread.running:
            raise TransferError("zmq sender is closed")
        common.check_host_layers(kv_layers)
        common.check_block_ids(spec.src_block_ids, kv_layers[0].shape[0], spec.request_id)
        staged = common.gather(kv_layers, spec.src_block_ids)
        self._table.add(spec.request_id, spec.timeout_s, spec.src_block_ids)
        job = _Job(spec, staged)
        if self._dice is not None:
            self._dice.mark(job)
        self._thread.put(job)

    def poll(self, request_id: str) -> KVPoll:
        return self._table.poll(request_id)

    def failure_reason(self, request_id: str) -> str | None:
        return self._table.reason(request_id)

    def release(self, request_id: str) -> None:
        self._table.pop(request_id)

    def notify(self, callback: Callable[[str, KVPoll], None] | None) -> None:
        self._table.on_finished = callback

    def close(self) -> None:
        if self._thread.stop() and self._own_ctx:
            self._ctx.term()

    def _header(self, spec: TransferSpec, staged: list[torch.Tensor]) -> KVHeader:
        """The header for one transfer (tests override it to corrupt a checksum)."""
        return common.make_header(
            spec.request_id,
            spec.dst_block_ids,
            staged,
            with_checksum=self.checksum,
            secret=spec.secret,
        )

    # ---- sender thread -----------------------------------------------------------------------

    def _run(self) -> None:
        sockets: dict[str, zmq.SyncSocket] = {}
        waiting: list[_Job] = []  # no live connection to their receiver yet (or queue full)
        trackers: dict[str, zmq.MessageTracker] = {}
        try:
            while self._thread.running:
                self._thread.wait((_BUSY_POLL_MS if trackers or waiting else _IDLE_POLL_MS) / 1e3)
                waiting += self._thread.take()
                waiting = [job for job in waiting if not self._push(job, sockets, trackers)]
                for rid, tracker in list(trackers.items()):
                    if tracker.done:
                        del trackers[rid]
                        self._table.advance(rid, KVPoll.DONE)
                for rid in self._table.expire():
                    trackers.pop(rid, None)
        finally:
            for sock in sockets.values():
                sock.close(linger=0)

    def _push(
        self,
        job: _Job,
        sockets: dict[str, zmq.SyncSocket],
        trackers: dict[str, zmq.MessageTracker],
    ) -> bool:
        """Hand one job to zmq; False to retry it later (no connection yet, queue full)."""
        rid, address = job.spec.request_id, job.spec.address
        state = gate(self._table, rid, job)
        if state is not JobGate.GO:
            return state is JobGate.OVER
        try:
            sock = sockets.get(address)
            if sock is None:
                # IMMEDIATE: queue only on a live connection, so an absent receiver times out
                options = {int(zmq.IMMEDIATE): 1}
                sock = make_socket(self._ctx, zmq.PUSH, address, bind=False, options=options)
                sockets[address] = sock
            if job.frames is None:
                header = encode(self._header(job.spec, job.staged))
                job.frames = [*header, *_faulty(job, [common.as_bytes(t) for t in job.staged])]
            tracker = sock.send_multipart(job.frames, flags=zmq.NOBLOCK, copy=False, track=True)
        except zmq.Again:
            return False
        except (OSError, zmq.ZMQError, ProtocolError) as exc:
            self._table.advance(rid, KVPoll.FAILED, f"cannot send to {address}: {exc}")
            return True
        if self._table.advance(rid, KVPoll.TRANSFERRING) and tracker is not None:
            trackers[rid] = tracker  # never None: sent with track=True
        return True


def _faulty(job: _Job, layers: list[memoryview]) -> list[memoryview]:
    """The layer frames as a faulty wire would deliver them (after the checksum was taken)."""
    if job.fault == "truncate":
        log.warning("injected fault: truncating transfer %r", job.spec.request_id)
        return layers[:-1]
    if job.fault == "corrupt":
        log.warning("injected fault: corrupting transfer %r", job.spec.request_id)
        first = bytearray(layers[0])
        first[len(first) // 2] ^= 0xFF
        return [memoryview(first), *layers[1:]]
    return layers


class ZmqKVReceiver(KVReceiver):
    """Parts: ``_table`` (the transfers), ``_reservations`` (``expect`` and the secret an
    arrival must present), ``_thread`` (the receiver thread, reading ``_sock``)."""

    def __init__(
        self,
        kv_layers: list[torch.Tensor],
        bind: str = DEFAULT_BIND,
        *,
        require_checksum: bool = False,
        ctx: zmq.SyncContext | None = None,
    ) -> None:
        self._layout = common.check_host_layers(kv_layers)
        self._layers = kv_layers
        self.require_checksum = require_checksum
        num_blocks = kv_layers[0].shape[0]
        self._table = TransferTable("zmq receiver")
        self._reservations = Reservations(self._table, num_blocks)
        self._thread = LoopThread("kv-zmq-receiver")
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.gate = RoleGate(security_of(self._ctx), Receiver.KV)  # prefill keys only
        # no frame may exceed a whole layer of this cache (set before bind, where it applies)
        limit = common.layer_nbytes(self._layout, num_blocks)
        self._sock = make_socket(self._ctx, zmq.PULL, bind, bind=True, max_msg_bytes=limit)
        self._address = bound_address(self._sock)
        self._thread.start(self._run)

    @property
    def address(self) -> str:
        return self._address

    def expect(
        self, request_id: str, dst_block_ids: list[int], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> bytes:
        return self._reservations.expect(request_id, dst_block_ids, timeout_s)

    def poll(self, request_id: str) -> KVPoll:
        return self._table.poll(request_id)

    def failure_reason(self, request_id: str) -> str | None:
        return self._table.reason(request_id)

    def release(self, request_id: str) -> None:
        self._table.pop(request_id)

    def close(self) -> None:
        if not self._thread.stop():
            return
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # ---- receiver thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while self._thread.running:
            if self._sock.poll(_IDLE_POLL_MS, zmq.POLLIN):
                frames = self._sock.recv_multipart(copy=False)
                try:
                    self._handle(frames)
                except Exception:  # a bad transfer must never kill the receiver
                    log.exception("zmq receiver: unexpected error handling a transfer")
            self._table.expire()

    def _handle(self, frames: list[zmq.Frame]) -> None:
        try:
            header = decode([frames[0].buffer])
        except ProtocolError as exc:
            log.warning("zmq receiver: dropped a transfer with a bad header: %s", exc)
            return
        if not isinstance(header, KVHeader):
            log.warning(
                "zmq receiver: dropped a %s where a KVHeader belongs", type(header).__name__
            )
            return
        if not self.gate.admit(header, sender_of(frames[0])):
            return
        rid = header.request_id
        with self._table.lock:
            entry = self._reservations.claim(rid, header.secret, "a transfer")
            if entry is None:
                return
            self._table.advance(rid, KVPoll.TRANSFERRING)
            dst_ids = entry.block_ids
        buffers = [f.buffer for f in frames[1:]]
        problem = common.header_problem(header, self._layout, dst_ids, self.require_checksum)
        problem = problem or common.payload_problem(header, self._layout, buffers)
        with self._table.lock:
            if self._table.get(rid) is not entry or entry.state.finished:
                return  # released or timed out meanwhile: its blocks may belong to others now
            if problem is None:
                common.scatter(self._layers, dst_ids, buffers)
            self._table.advance(rid, KVPoll.FAILED if problem else KVPoll.DONE, problem)
