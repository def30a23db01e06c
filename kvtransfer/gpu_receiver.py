"""The receiver half of the GPU backends' control machinery, apart from the transport itself
(a ``RecvLink``: NCCL's is ``nccl_backend.NcclRecvLink``); the sender half is in
``gpu_sender``.

It binds a ZMQ ROUTER (its ``address``) and, on its own thread, answers senders::

    expect() PENDING ─Begin granted─▶ TRANSFERRING ─Done, and the link's local work done─▶
    layer count and checksum checked ─▶ DONE | FAILED

A Begin is granted only while the request is PENDING with exactly those blocks, so a sender
never starts writing into blocks the decode worker has given up on. The link supplies
``status``, the handshake (``on_hello``, ``after_reply``) and the local work of a granted
transfer (``on_begin``: post the recvs); the tests replace the ``_on_hello`` / ``_on_begin``
seams to drive this machinery on CPU. Not run on a GPU yet.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import zmq

from pdserve.kvtransfer import gpu_wire as w
from pdserve.kvtransfer.base import (
    DEFAULT_TIMEOUT_S,
    KVLayout,
    KVPoll,
    KVReceiver,
    LayoutMismatchError,
    check_layouts,
)
from pdserve.kvtransfer.table import Reservations, TransferTable, secret_matches
from pdserve.kvtransfer.threads import LoopThread
from pdserve.protocol.checks import ProtocolError
from pdserve.protocol.roles import Receiver
from pdserve.runtime.gate import RoleGate
from pdserve.runtime.security import security_of
from pdserve.runtime.sockets import bound_address, make_socket, sender_of

log = logging.getLogger("pdserve.kvtransfer.gpu")

DEFAULT_BIND = "tcp://127.0.0.1:0"
_IDLE_POLL_MS, _BUSY_POLL_MS = 50, 1


@dataclass
class Incoming:
    identity: bytes
    done: w.Done | None = None
    event: Any = None  # torch.cuda.Event of the link's local work (nccl: the recvs)
    finish: Callable[[], None] | None = None  # run once the event completes, under the lock
    keep: Any = None  # buffers alive until the event completes


class RecvLink(Protocol):
    """The transport's part of a GPU receiver (NCCL's: ``nccl_backend.NcclRecvLink``)."""

    @property
    def backend(self) -> str: ...

    def status(self) -> tuple[bool, str]:
        """Whether the transport can run here, and why not (``engine.platform``)."""
        ...

    def on_hello(self, identity: bytes, hello: w.Hello, session: str) -> Any:
        """The reply to a new sender (handles, unique id, or Refused)."""
        ...

    def after_reply(self, identity: bytes, reply: Any) -> None:
        """Runs once ``reply`` is handed to zmq (nccl: join the communicator)."""
        ...

    def on_begin(self, identity: bytes, begin: w.Begin, incoming: Incoming) -> str | None:
        """Start the local work for a granted transfer (nccl: post the recvs); a reason to
        decline it instead."""
        ...


class _NoLink:
    """A GPU receiver given no link: unusable, unless a subclass replaces the seams."""

    backend = "gpu"

    def status(self) -> tuple[bool, str]:
        return False, "no transport link"

    def on_hello(self, identity: bytes, hello: w.Hello, session: str) -> Any:
        return w.Refused("this receiver has no transport link")

    def after_reply(self, identity: bytes, reply: Any) -> None:
        pass

    def on_begin(self, identity: bytes, begin: w.Begin, incoming: Incoming) -> str | None:
        return None


class GpuKVReceiver(KVReceiver):
    """Parts: ``link`` (the transport), ``_table`` (the transfers), ``_reservations``
    (``expect``), ``_thread`` (the receiver thread, answering on ``_sock``), ``gate`` (which
    keys may send), ``_digest`` (the checksum of what landed); the thread's ``_incoming``."""

    def __init__(
        self,
        kv_layers: list[torch.Tensor],
        bind: str = DEFAULT_BIND,
        *,
        require_checksum: bool = False,
        ctx: zmq.SyncContext | None = None,
        link: RecvLink | None = None,
    ) -> None:
        self.link: RecvLink = link if link is not None else _NoLink()
        w.require(self.status(), self.backend)
        self._layout = self._check_layers(kv_layers)
        self._layers = kv_layers
        self.require_checksum = require_checksum
        self._device = kv_layers[0].device
        self.session = secrets.token_hex(8)
        self._digest = w.DeviceChecksum()
        self._stream = self._side_stream()
        self._table = TransferTable(f"{self.backend} receiver")
        self._reservations = Reservations(self._table, kv_layers[0].shape[0])
        self._thread = LoopThread(f"kv-{self.backend}-receiver")
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.gate = RoleGate(security_of(self._ctx), Receiver.KV)  # prefill keys only
        self._incoming: dict[str, Incoming] = {}  # receiver thread only
        # control messages only; set before bind, where it applies
        self._sock = make_socket(self._ctx, zmq.ROUTER, bind, bind=True, max_msg_bytes=1 << 20)
        self._address = bound_address(self._sock)
        self._thread.start(self._run)

    @property
    def backend(self) -> str:
        return self.link.backend

    def status(self) -> tuple[bool, str]:
        return self.link.status()

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
        # a granted transfer lands in staging first and is scattered only while still wanted
        self._table.pop(request_id)

    def close(self) -> None:
        if not self._thread.stop():
            return
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # ---- seams: the link's and the GPU's (the tests' CPU loopback replaces them) -------------
    def _on_hello(self, identity: bytes, hello: w.Hello) -> Any:
        return self.link.on_hello(identity, hello, self.session)

    def _after_reply(self, identity: bytes, reply: Any) -> None:
        self.link.after_reply(identity, reply)

    def _on_begin(self, identity: bytes, begin: w.Begin, incoming: Incoming) -> str | None:
        return self.link.on_begin(identity, begin, incoming)

    def _check_layers(self, kv_layers: list[torch.Tensor]) -> KVLayout:
        return w.check_device_layers(kv_layers)

    def _side_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]  # untyped in torch

    # ---- receiver thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while self._thread.running:
            timeout = _BUSY_POLL_MS if self._incoming else _IDLE_POLL_MS
            if self._sock.poll(timeout, zmq.POLLIN):
                parts = self._sock.recv_multipart(copy=False)
                try:
                    # [identity, message]: anything else is not a sender's (dropped)
                    identity = parts[0].bytes
                    reply = None
                    if len(parts) == 2:
                        reply = self._handle(identity, parts[1].bytes, sender_of(parts[1]))
                    else:
                        log.warning("%s receiver: dropped %d frames", self.backend, len(parts))
                    if reply is not None:
                        self._sock.send_multipart([identity, w.encode(reply)])
                        self._after_reply(identity, reply)
                except Exception:  # a bad message must never kill the receiver
                    log.exception("%s receiver: error handling a control message", self.backend)
            self._complete()
            self._table.expire()

    def _handle(self, identity: bytes, frame: bytes, sender: str = "") -> Any:
        try:
            msg = w.decode(frame)
        except ProtocolError as exc:
            log.warning("%s receiver: dropped a bad control message: %s", self.backend, exc)
            return None
        if not self.gate.admit_tag(w.TAGS[type(msg)], sender):
            return None
        if isinstance(msg, w.Hello):
            if msg.backend != self.backend:
                return w.Refused(f"this receiver speaks {self.backend}, not {msg.backend}")
            try:
                check_layouts(msg.layout, self._layout, ("sender", "receiver"))
            except LayoutMismatchError as exc:
                return w.Refused(str(exc))
            return self._on_hello(identity, msg)
        if isinstance(msg, w.Begin):
            return self._grant(identity, msg)
        if isinstance(msg, w.Done):
            incoming = self._incoming.get(msg.request_id)
            if incoming is None or incoming.identity != identity:
                log.warning("%s receiver: Done for unknown %r", self.backend, msg.request_id)
            else:
                incoming.done = msg
            return None
        log.warning("%s receiver: unexpected %s", self.backend, type(msg).__name__)
        return None

    def _grant(self, identity: bytes, begin: w.Begin) -> w.BeginReply:
        rid = begin.request_id
        with self._table.lock:
            entry = self._table.get(rid)
            if entry is None or entry.state is not KVPoll.PENDING:
                why = "not expected" if entry is None else f"already {entry.state.value}"
            elif not secret_matches(entry, begin.secret):
                why = "came without its transfer secret"
            elif entry.block_ids != begin.dst_block_ids:
                why = "destination blocks differ from the reserved ones"
            else:
                incoming = Incoming(identity)
                declined = self._on_begin(identity, begin, incoming)
                if declined is None:
                    self._incoming[rid] = incoming
                    self._table.advance(rid, KVPoll.TRANSFERRING)
                    return w.BeginReply(rid, self.session, True, "")
                why = declined
        return w.BeginReply(rid, self.session, False, f"request {rid!r} {why}")

    def _complete(self) -> None:
        for rid, inc in list(self._incoming.items()):
            if inc.event is not None and not inc.event.query():
                continue  # local work in flight: its buffers stay referenced until it ends
            with self._table.lock:
                entry = self._table.get(rid)
                if entry is None or entry.state is not KVPoll.TRANSFERRING:
                    del self._incoming[rid]  # released or timed out: nothing is applied
                    continue
                if inc.done is None:
                    continue
                del self._incoming[rid]
                problem = self._problem(inc.done, entry.block_ids, inc.finish)
                self._table.advance(rid, KVPoll.FAILED if problem else KVPoll.DONE, problem)

    def _problem(
        self, done: w.Done, block_ids: list[int], finish: Callable[[], None] | None
    ) -> str | None:
        if done.layers != self._layout.num_layers:
            return f"{done.layers} of {self._layout.num_layers} layers written"
        if finish is not None:
            finish()
        if done.checksum is None:
            return "no checksum sent, one is required" if self.require_checksum else None
        with torch.cuda.stream(self._stream):
            if self._digest(self._layers, block_ids) != done.checksum:
                return "checksum mismatch"
        return None
