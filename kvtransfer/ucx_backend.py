"""KV transfer over UCX through ``ucxx`` (its low-level API; the asyncio layer is not used).

On this machine UCX runs over TCP between host buffers; a CUDA-enabled UCX moves the same tag
messages between device buffers (cuda_ipc, RDMA) once staging happens on the GPU.

One transfer = tag messages to the receiver's UCX worker, T a random 47-bit transfer tag::

    HEADER_TAG         KVHeader (protocol codec) with tag = T
    (T << 16) | l      layer l: the gathered source blocks, [n, 2, block_size, H, D] raw bytes

This module holds the sender and what both sides share; the receiver (``ucx_receiver``)
drains whatever it does not accept, so no sender is left waiting on an unmatched message.
Each sender and receiver owns a UCX context and worker progressed by UCX's own thread; a
Python thread drives the transfers by polling, since UCX completions reach Python only
through asyncio futures. ``ucxx`` is imported on first use (importing it sets ``UCX_*``
environment variables for the process); ``ucx_unavailable_reason`` says whether it can be.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvtransfer import common, table
from pdserve.kvtransfer.base import KVPoll, KVSender, TransferError, TransferSpec
from pdserve.protocol.messages import KVHeader, ProtocolError, encode

log = logging.getLogger("pdserve.kvtransfer.ucx")

DEFAULT_BIND = "ucx://127.0.0.1:0"
HEADER_TAG = 1 << 63  # layer tags are below 2**63
HELLO = b"pdkv\x00\x00\x00\x01"  # stream message a receiver sends on every new connection
BUSY_SLEEP_S = 0.0002
IDLE_SLEEP_S = 0.002


def ucx_unavailable_reason() -> str | None:
    """None when the ucx backend can run here, else why not."""
    try:
        import ucxx._lib.libucxx  # noqa: F401
    except Exception as exc:  # ImportError, or a missing/broken libucx behind it
        return f"ucxx is not importable: {type(exc).__name__}: {exc}"
    return None


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.removeprefix("ucx://").rpartition(":")
    if not address.startswith("ucx://") or not sep or not port.isdigit():
        raise ValueError(f"UCX address must look like ucx://<host>:<port>, got {address!r}")
    return host.strip("[]"), int(port)


def layer_tag(tag: int, layer: int) -> int:
    return (tag << 16) | layer


class UcxWorker:
    """One UCX context and worker, progressed by UCX's own thread."""

    def __init__(self) -> None:
        reason = ucx_unavailable_reason()
        if reason is not None:
            raise TransferError(reason)
        from ucxx._lib import libucxx
        from ucxx._lib.arr import Array

        self.lib, self.Array = libucxx, Array
        flags = (libucxx.Feature.TAG, libucxx.Feature.STREAM, libucxx.Feature.WAKEUP)
        # ucxx sets UCX_* variables this UCX does not know; keep UCX from warning about them
        self.context = libucxx.UCXContext({"WARN_UNUSED_ENV_VARS": "n"}, feature_flags=flags)
        self.worker = libucxx.UCXWorker(self.context, enable_delayed_submission=True)
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=1)

    def tag(self, value: int) -> Any:
        return self.lib.UCXXTag(value)

    def probe(self, tag: int) -> Any:
        return self.worker.tag_probe(self.tag(tag), remove=True)

    def recv(self, buf: Any, probe: Any) -> Any:
        return self.worker.tag_recv_with_handle(self.Array(buf), probe)

    def close(self) -> None:
        self.worker.stop_progress_thread()


def request_error(req: Any) -> str | None:
    try:
        req.check_error()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@dataclass
class _Peer:
    """A connection to one receiver; usable once the receiver's HELLO arrived on it.

    UCX 1.21 spins forever inside ``ucp_tag_send_nbx`` on an endpoint whose connection is
    refused before it was ever established (holding the request's lock, so polling the
    request hangs too); a stream receive fails cleanly instead. So nothing is sent before
    the HELLO.
    """

    ep: Any
    deadline: float
    hello: bytearray = field(default_factory=lambda: bytearray(len(HELLO)))
    req: Any = None
    connected: bool = False
    error: str | None = None

    def check(self) -> None:
        if self.connected or self.error:
            return
        if self.req.completed:
            self.error = request_error(self.req)
            if self.error is None and bytes(self.hello) != HELLO:
                self.error = "the peer is not a pdserve KV receiver"
            self.connected = self.error is None
        elif time.monotonic() > self.deadline:
            self.error = "connection timed out"
        elif not self.ep.alive:
            self.error = "connection refused or lost"


@dataclass
class _Outgoing:
    header: bytes  # header and staged stay referenced until UCX is done reading them:
    staged: list[torch.Tensor]  # with delayed submission it reads them from its own thread
    reqs: list[Any] = field(default_factory=list)


_Job = tuple[TransferSpec, list[torch.Tensor]]


class UcxKVSender(table.TableBacked, KVSender):
    def __init__(self, *, checksum: bool = False) -> None:
        self.checksum = checksum
        self._ucx = UcxWorker()
        self._table = table.TransferTable("ucx sender")
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-ucx-sender", daemon=True)
        self._thread.start()

    def send(self, spec: TransferSpec, kv_layers: list[torch.Tensor]) -> None:
        if self._stop.is_set():
            raise TransferError("ucx sender is closed")
        parse_address(spec.address)
        common.check_host_layers(kv_layers)
        common.check_block_ids(spec.src_block_ids, kv_layers[0].shape[0], spec.request_id)
        staged = common.gather(kv_layers, spec.src_block_ids)
        self._table.add(spec.request_id, spec.timeout_s, spec.src_block_ids)
        self._jobs.put((spec, staged))

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._ucx.close()

    def _header(self, spec: TransferSpec, staged: list[torch.Tensor], tag: int) -> KVHeader:
        """The header for one transfer (tests override it to corrupt a checksum)."""
        return common.make_header(
            spec.request_id,
            spec.dst_block_ids,
            staged,
            with_checksum=self.checksum,
            tag=tag,
            secret=spec.secret,
        )

    def _run(self) -> None:
        peers: dict[str, _Peer] = {}
        waiting: list[_Job] = []  # their receiver is still connecting
        inflight: dict[str, _Outgoing] = {}
        orphans: list[_Outgoing] = []  # failed or released, UCX may still read their buffers
        try:
            while not self._stop.is_set():
                try:
                    busy = bool(inflight or waiting)
                    waiting.append(self._jobs.get(timeout=BUSY_SLEEP_S if busy else 0.05))
                except queue.Empty:
                    pass
                waiting = [job for job in waiting if not self._push(*job, peers, inflight)]
                for rid, out in list(inflight.items()):
                    if self._table.get(rid) is None or self._table.poll(rid).finished:
                        orphans.append(inflight.pop(rid))  # released or timed out
                    elif all(r.completed for r in out.reqs):
                        del inflight[rid]
                        errors = [e for e in map(request_error, out.reqs) if e]
                        state = KVPoll.FAILED if errors else KVPoll.DONE
                        self._table.advance(rid, state, errors[0] if errors else None)
                orphans = [o for o in orphans if not all(r.completed for r in o.reqs)]
                self._table.expire()
        finally:
            for peer in peers.values():
                peer.ep.close_blocking(period=10**9, max_attempts=1)

    def _connect(self, address: str, deadline: float) -> _Peer:
        host, port = parse_address(address)
        peer = _Peer(self._ucx.lib.UCXEndpoint.create(self._ucx.worker, host, port, True), deadline)
        peer.req = peer.ep.stream_recv(self._ucx.Array(peer.hello))
        return peer

    def _push(self, spec: TransferSpec, staged: list, peers: dict, inflight: dict) -> bool:
        """Start one transfer; False to retry it later (its receiver is still connecting)."""
        rid, address = spec.request_id, spec.address
        entry = self._table.get(rid)
        if entry is None or entry.state.finished:
            return True  # released or timed out before it left
        try:
            peer = peers.get(address)
            if peer is None or peer.error or (peer.connected and not peer.ep.alive):
                peer = peers[address] = self._connect(address, entry.deadline)
            peer.check()
            if peer.error:
                self._table.advance(
                    rid, KVPoll.FAILED, f"cannot connect to {address}: {peer.error}"
                )
                return True
            if not peer.connected:
                return False
            tag = secrets.randbits(47) or 1
            (header,) = encode(self._header(spec, staged, tag))
            out = _Outgoing(header, staged)
            ep = peer.ep
            out.reqs.append(ep.tag_send(self._ucx.Array(out.header), self._ucx.tag(HEADER_TAG)))
            for layer, t in enumerate(staged):
                buf = self._ucx.Array(common.as_bytes(t))
                out.reqs.append(ep.tag_send(buf, self._ucx.tag(layer_tag(tag, layer))))
        except (ProtocolError, RuntimeError, ValueError, OSError) as exc:  # UCXError: RuntimeError
            self._table.advance(rid, KVPoll.FAILED, f"cannot send to {address}: {exc}")
            return True
        inflight[rid] = out
        self._table.advance(rid, KVPoll.TRANSFERRING)
        return True
