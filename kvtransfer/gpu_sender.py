"""The sender half of the GPU backends' control machinery, apart from the transport itself
(a ``SendLink``: NCCL's is ``nccl_backend.NcclSendLink``); the receiver half is in
``gpu_receiver``, the messages in ``gpu_wire``.

Per transfer, on the sender's own thread::

    send(): record an event on the caller's stream (the KV is written up to here) ─▶ queue
    thread: handshake with the receiver once ─▶ Begin ⇄ BeginReply(ok) ─▶ GPU work on a side
            stream after that event, then a done event ─▶ done event completes ─▶ DONE, and
            Done(rid, layers, checksum) to the receiver

Sender DONE means the bytes are in the receiver's blocks (stronger than the host backends').
The link supplies ``status``, the handshake and the GPU work (``issue``); the tests replace
the ``_connect`` / ``_launch`` seams to drive this machinery on CPU. Not run on a GPU yet.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import zmq

from pdserve.kvtransfer import common
from pdserve.kvtransfer import gpu_wire as w
from pdserve.kvtransfer.base import KVLayout, KVPoll, KVSender, TransferError, TransferSpec
from pdserve.kvtransfer.faults import FaultDice, FaultPlan
from pdserve.kvtransfer.table import TransferTable
from pdserve.kvtransfer.threads import SenderThread
from pdserve.protocol.checks import ProtocolError
from pdserve.runtime.sockets import make_socket

log = logging.getLogger("pdserve.kvtransfer.gpu")

ROUND_TRIP_S = 10.0  # longest wait for one control reply (capped by the transfer's deadline)
_IDLE_POLL_MS, _BUSY_POLL_MS = 50, 1
_FAILURES = (TransferError, OSError, zmq.ZMQError, ProtocolError, RuntimeError, ValueError)


def round_trip(
    sock: zmq.SyncSocket, msg: Any, want: type, deadline: float, key: str = ""
) -> Any:  # Any: the ``want`` reply, one of gpu_wire's message classes
    """Send ``msg``, return the first ``want`` reply (for request ``key`` when it has one);
    ``TransferError`` on ``Refused`` or at the deadline. Stale replies are skipped."""
    sock.send(w.encode(msg))
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            break
        reply = w.decode(sock.recv())
        if isinstance(reply, w.Refused):
            raise TransferError(f"receiver refused: {reply.reason}")
        if isinstance(reply, want) and getattr(reply, "request_id", key) == key:
            return reply
    raise TransferError(f"no {want.__name__} from the receiver in time")


@dataclass
class Peer:
    """A sender's connection to one receiver; ``data``: the link's opened state."""

    address: str
    sock: zmq.SyncSocket
    session: str
    data: Any = None  # Any: the link's (nccl: a cupy NcclCommunicator)


@dataclass
class Job:
    spec: TransferSpec
    layers: list[torch.Tensor]
    layout: KVLayout
    ready: Any  # torch.cuda.Event (or a CPU stand-in with ``query``)
    fault: str | None = None
    not_before: float = 0.0


@dataclass
class Flight:
    peer: Peer
    event: Any  # torch.cuda.Event: query() is True once the bytes landed
    layers: int
    checksum: bytes | None
    keep: Any = None  # staging buffers alive until the event completes


class SendLink(Protocol):
    """The transport's part of a GPU sender (NCCL's: ``nccl_backend.NcclSendLink``)."""

    @property
    def backend(self) -> str: ...

    def status(self) -> tuple[bool, str]:
        """Whether the transport can run here, and why not (``engine.platform``)."""
        ...

    def handshake(self, sock: zmq.SyncSocket, job: Job, deadline: float) -> tuple[str, Any]:
        """Open the link to a new receiver over ``sock``: (its session, the opened state)."""
        ...

    def issue(
        self, peer: Peer, job: Job, stream: torch.cuda.Stream, digest: bytes | None
    ) -> Flight:
        """Enqueue the transfer's GPU work on ``stream`` (already after ``job.ready``)."""
        ...


class _NoLink:
    """A GPU sender given no link: unusable, unless a subclass replaces the seams."""

    backend = "gpu"

    def status(self) -> tuple[bool, str]:
        return False, "no transport link"

    def handshake(self, sock: zmq.SyncSocket, job: Job, deadline: float) -> tuple[str, Any]:
        raise TransferError("no transport link")

    def issue(
        self, peer: Peer, job: Job, stream: torch.cuda.Stream, digest: bytes | None
    ) -> Flight:
        raise TransferError("no transport link")


class GpuKVSender(KVSender):
    """Parts: ``link`` (the transport), ``_table`` (the transfers), ``_thread`` (the sender
    thread and its queue), ``_dice`` (the injected fault, if any), ``_digest`` (the source
    checksum); the thread's peers, flights and side streams."""

    def __init__(
        self,
        *,
        checksum: bool = False,
        fault: FaultPlan | None = None,
        ctx: zmq.SyncContext | None = None,
        link: SendLink | None = None,
    ) -> None:
        self.link: SendLink = link if link is not None else _NoLink()
        w.require(self.status(), self.backend)
        self.checksum = checksum
        self._digest = w.DeviceChecksum()
        self._table = TransferTable(f"{self.backend} sender")
        self._dice = FaultDice(fault) if fault is not None else None
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self._peers: dict[str, Peer] = {}  # sender thread only
        self._flights: dict[str, Flight] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._thread: SenderThread[Job] = SenderThread(f"kv-{self.backend}-sender")
        self._thread.start(self._run)

    @property
    def backend(self) -> str:
        return self.link.backend

    def status(self) -> tuple[bool, str]:
        return self.link.status()

    # ---- caller side -------------------------------------------------------------------------
    def send(self, spec: TransferSpec, kv_layers: list[torch.Tensor]) -> None:
        if not self._thread.running:
            raise TransferError(f"{self.backend} sender is closed")
        layout = self._check_layers(kv_layers)
        common.check_block_ids(spec.src_block_ids, kv_layers[0].shape[0], spec.request_id)
        ready = self._ready_event(kv_layers[0].device)
        self._table.add(spec.request_id, spec.timeout_s, spec.src_block_ids)
        job = Job(spec, kv_layers, layout, ready)
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

    # ---- sender thread -------------------------------------------------------------------------
    def _run(self) -> None:
        waiting: list[Job] = []
        try:
            while self._thread.running:
                busy = bool(waiting or self._flights)
                self._thread.wait((_BUSY_POLL_MS if busy else _IDLE_POLL_MS) / 1e3)
                waiting += self._thread.take()
                now = time.monotonic()
                for job in [j for j in waiting if j.not_before <= now]:
                    waiting.remove(job)
                    self._start(job)
                self._land()
                self._table.expire()
        finally:
            for peer in self._peers.values():
                peer.sock.close(linger=0)

    def _start(self, job: Job) -> None:
        rid = job.spec.request_id
        entry = self._table.get(rid)
        if entry is None or entry.state.finished:
            return  # released or timed out before it left
        if job.fault == "drop":
            log.warning("injected fault: dropping transfer %r", rid)
            self._table.advance(rid, KVPoll.DONE)
            return
        deadline = min(entry.deadline, time.monotonic() + ROUND_TRIP_S)
        address = job.spec.address
        try:
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = self._connect(address, job, deadline)
            begin = w.Begin(rid, list(job.spec.dst_block_ids), job.spec.secret)
            reply = round_trip(peer.sock, begin, w.BeginReply, deadline, key=rid)
            if reply.session != peer.session:
                self._drop_peer(address)
                raise TransferError("the receiver restarted; its communicator is stale")
            if not reply.ok:
                raise TransferError(f"receiver declined: {reply.reason}")
            self._flights[rid] = self._launch(peer, job)
        except _FAILURES as exc:
            if isinstance(exc, (zmq.ZMQError, ProtocolError)):
                self._drop_peer(address)
            self._table.advance(rid, KVPoll.FAILED, f"{address}: {exc}")
            return
        self._table.advance(rid, KVPoll.TRANSFERRING)

    def _land(self) -> None:
        for rid, flight in list(self._flights.items()):
            if not flight.event.query():
                continue
            del self._flights[rid]
            self._table.advance(rid, KVPoll.DONE)
            try:
                flight.peer.sock.send(w.encode(w.Done(rid, flight.layers, flight.checksum)))
            except zmq.ZMQError as exc:
                log.warning(
                    "%s sender: cannot notify %s: %s", self.backend, flight.peer.address, exc
                )

    # ---- seams: the link's and the GPU's (the tests' CPU loopback replaces them) -------------
    def _connect(self, address: str, job: Job, deadline: float) -> Peer:
        """A connection to a new receiver, its link opened (nccl: the communicator)."""
        sock = self._dealer(address)
        try:
            session, data = self.link.handshake(sock, job, deadline)
        except BaseException:
            sock.close(linger=0)
            raise
        return Peer(address, sock, session, data)

    def _launch(self, peer: Peer, job: Job) -> Flight:
        stream = self._stream(job.layers[0].device)
        stream.wait_event(job.ready)
        with torch.cuda.stream(stream):
            return self.link.issue(peer, job, stream, self._source_digest(job))

    def _check_layers(self, kv_layers: list[torch.Tensor]) -> KVLayout:
        return w.check_device_layers(kv_layers)

    def _ready_event(self, device: torch.device) -> Any:  # Any: torch.cuda.Event
        """An event after everything the caller's stream has queued (the KV to send)."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        event.record(torch.cuda.current_stream(device))
        return event

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self._streams[device]

    def _drop_peer(self, address: str) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            peer.sock.close(linger=0)

    def _dealer(self, address: str) -> zmq.SyncSocket:
        return make_socket(self._ctx, zmq.DEALER, address, bind=False)

    def _source_digest(self, job: Job) -> bytes | None:
        """Checksum of the source blocks (on the current, side, stream; blocks this thread)."""
        return self._digest(job.layers, job.spec.src_block_ids) if self.checksum else None


def sender_hello(backend: str, job: Job) -> w.Hello:
    return w.Hello(backend, job.layout, os.getpid(), w.gpu_uuid(job.layers[0].device))
