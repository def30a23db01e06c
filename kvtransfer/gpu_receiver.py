"""The receiver half of the ``nccl`` backend's control machinery, apart from NCCL itself
(``nccl_backend``); the sender half is in ``gpu_sender``.

It binds a ZMQ ROUTER (its ``address``) and, on its own thread, answers senders::

    expect() PENDING ─Begin granted─▶ TRANSFERRING ─Done, and the backend's local work done─▶
    layer count and checksum checked ─▶ DONE | FAILED

A Begin is granted only while the request is PENDING with exactly those blocks, so a sender
never starts writing into blocks the decode worker has given up on. ``nccl_backend`` supplies
``status``, ``_on_hello`` (the handshake) and ``_on_begin`` (post the recvs); the tests drive
this machinery on CPU through a loopback subclass. Not run on a GPU yet.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from pdserve.kvtransfer import gpu_wire as w
from pdserve.kvtransfer import table
from pdserve.kvtransfer.base import (
    KVLayout,
    KVPoll,
    KVReceiver,
    LayoutMismatchError,
    check_layouts,
)
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
    event: Any = None  # torch.cuda.Event of the backend's local work (nccl: the recvs)
    finish: Any = None  # callable run once the event completes, under the table lock
    keep: Any = None


class GpuKVReceiver(table.TableBackedReceiver, KVReceiver):
    backend = "gpu"

    def __init__(
        self,
        kv_layers: list[torch.Tensor],
        bind: str = DEFAULT_BIND,
        *,
        require_checksum: bool = False,
        ctx: zmq.Context | None = None,
    ) -> None:
        w.require(self.status(), self.backend)
        self._layout = self._check_layers(kv_layers)
        self._init_receiver(self.backend, kv_layers, require_checksum)
        self._device = kv_layers[0].device
        self._gpu = w.gpu_uuid(self._device)
        self.session = secrets.token_hex(8)
        self._digest = w.DeviceChecksum()
        self._stream = self._side_stream()
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self.gate = RoleGate(security_of(self._ctx), Receiver.KV)  # prefill keys only
        self._incoming: dict[str, Incoming] = {}  # receiver thread only
        # control messages only; set before bind, where it applies
        self._sock = make_socket(self._ctx, zmq.ROUTER, bind, bind=True, max_msg_bytes=1 << 20)
        self._start_thread(self.backend, bound_address(self._sock))

    @staticmethod
    def status() -> tuple[bool, str]:
        raise NotImplementedError

    def _on_hello(self, identity: bytes, hello: w.Hello) -> Any:
        """The reply to a new sender (handles, unique id, or Refused)."""
        raise NotImplementedError

    def _after_reply(self, identity: bytes, reply: Any) -> None:
        """Runs once ``reply`` is handed to zmq (nccl: join the communicator)."""

    def _on_begin(self, identity: bytes, begin: w.Begin, incoming: Incoming) -> str | None:
        """Start the backend's local work for a granted transfer (nccl: post the recvs);
        a reason to decline it instead."""
        return None

    def _check_layers(self, kv_layers: list[torch.Tensor]) -> KVLayout:
        return w.check_device_layers(kv_layers)

    def _side_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(self._device)

    def release(self, request_id: str) -> None:
        # a granted transfer lands in staging first and is scattered only while still wanted
        self._table.pop(request_id)

    def close(self) -> None:
        if not self._stop_thread():
            return
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    # ---- receiver thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
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
            elif not table.secret_matches(entry, begin.secret):
                why = "came without its transfer secret"
            elif entry.block_ids != begin.dst_block_ids:
                why = "destination blocks differ from the reserved ones"
            else:
                incoming = Incoming(identity)
                why = self._on_begin(identity, begin, incoming)
                if why is None:
                    self._incoming[rid] = incoming
                    self._table.advance(rid, KVPoll.TRANSFERRING)
                    return w.BeginReply(rid, self.session, True, "")
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

    def _problem(self, done: w.Done, block_ids: list[int], finish: Any) -> str | None:
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
