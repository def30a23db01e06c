"""KV transfer over NCCL through cupy's binding (``cupy.cuda.nccl``): one communicator per
prefill/decode pair (sender rank 0, receiver rank 1), set up over the control channel.

    decode (receiver)                            prefill (sender)
    Hello(gpu) ◀───────────────────────────────  first transfer to this address
    NcclUniqueId(id) ──────────────────────────▶
    NcclCommunicator(2, id, 1) ◀─ both block ─▶  NcclCommunicator(2, id, 0)
    Begin ⇄ BeginReply(ok): on the pair's        gather src blocks into one staging buffer
    stream, groupStart, recv per layer into      [L, n, 2, bs, KV, D]; groupStart, send per
    staging, groupEnd, event                     layer, groupEnd, event ─▶ Done(rid, ...)
    recv event done + Done ─▶ scatter staging into the dst blocks (under the lock, only if the
    request is still wanted: a released transfer never touches its blocks) ─▶ checksum ─▶ DONE

This module is NCCL's part of a GPU sender and receiver (``NcclSendLink``, ``NcclRecvLink``:
parts they hold); ``nccl_sender`` / ``nccl_receiver`` build the pair for ``make_sender``. The
handshake and checks are ``gpu_sender`` / ``gpu_receiver``; the messages ``gpu_wire``.
NCCL needs one GPU per rank, so the two ends must be on different GPUs (one card: nixl).
Known hazards, from NCCL itself: cupy's communicator init holds the GIL until the peer joins
(the receiver joins only after its reply is on the wire, the sender as soon as it reads it),
and a peer that dies mid-transfer leaves the pair's stream waiting for ever. An injected
``truncate`` still sends every layer (NCCL sends and recvs must match) and reports one fewer.
``nccl_self_test`` exercises the binding on one GPU (one rank sending to itself).

NOT yet run on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from pdserve.engine.platform import cupy_nccl_status
from pdserve.kvtransfer import gpu_wire as w
from pdserve.kvtransfer.faults import FaultPlan
from pdserve.kvtransfer.gpu_receiver import DEFAULT_BIND, GpuKVReceiver, Incoming, log
from pdserve.kvtransfer.gpu_sender import Flight, GpuKVSender, Job, Peer, round_trip, sender_hello

_BYTE_TYPES = ("NCCL_UINT8", "NCCL_INT8", "NCCL_CHAR")


def _nccl() -> Any:  # Any: cupy ships no types
    from cupy.cuda import nccl

    return nccl


def _byte_type(nccl: Any) -> int:
    byte: int = next(getattr(nccl, n) for n in _BYTE_TYPES if hasattr(nccl, n))
    return byte


def _communicator(
    device: torch.device, size: int, unique_id: list[int], rank: int
) -> Any:  # Any: cupy's NcclCommunicator
    import cupy

    with cupy.cuda.Device(device.index or 0):
        return _nccl().NcclCommunicator(size, tuple(unique_id), rank)


def _group(comm: Any, op: str, buffers: list[torch.Tensor], peer: int, stream: Any) -> None:
    """One NCCL group: ``op`` ("send" | "recv") of every buffer, raw bytes, on ``stream``."""
    import cupy

    nccl = _nccl()
    byte = _byte_type(nccl)
    with cupy.cuda.Device(buffers[0].device.index or 0):
        nccl.groupStart()
        try:
            for buf in buffers:
                nbytes = buf.numel() * buf.element_size()
                getattr(comm, op)(buf.data_ptr(), nbytes, byte, peer, stream.cuda_stream)
        finally:
            nccl.groupEnd()


def nccl_sender(
    *, checksum: bool = False, fault: FaultPlan | None = None, ctx: zmq.SyncContext | None = None
) -> GpuKVSender:
    """The nccl backend's sender: a GPU sender holding NCCL's link."""
    return GpuKVSender(checksum=checksum, fault=fault, ctx=ctx, link=NcclSendLink())


def nccl_receiver(
    kv_layers: list[torch.Tensor],
    bind: str = DEFAULT_BIND,
    *,
    require_checksum: bool = False,
    ctx: zmq.SyncContext | None = None,
) -> GpuKVReceiver:
    """The nccl backend's receiver: a GPU receiver holding NCCL's link."""
    link = NcclRecvLink(kv_layers)
    return GpuKVReceiver(kv_layers, bind, require_checksum=require_checksum, ctx=ctx, link=link)


class NcclSendLink:
    """NCCL's part of a GPU sender (rank 0 of each pair): the communicator a handshake opens,
    and a transfer's sends, from one staging buffer of the source blocks."""

    backend = "nccl"

    def status(self) -> tuple[bool, str]:
        return cupy_nccl_status()

    def handshake(self, sock: zmq.SyncSocket, job: Job, deadline: float) -> tuple[str, Any]:
        reply = round_trip(sock, sender_hello(self.backend, job), w.NcclUniqueId, deadline)
        return reply.session, _communicator(job.layers[0].device, 2, reply.unique_id, 0)

    def issue(
        self, peer: Peer, job: Job, stream: torch.cuda.Stream, digest: bytes | None
    ) -> Flight:
        idx = torch.tensor(job.spec.src_block_ids, dtype=torch.long, device=stream.device)
        staging = torch.stack([layer.index_select(0, idx) for layer in job.layers])
        if job.fault == "corrupt":
            staging.view(-1).view(torch.uint8)[:1].bitwise_xor_(0xFF)
        _group(peer.data, "send", list(staging), 1, stream)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
        done.record(stream)
        count = len(job.layers) - (job.fault == "truncate")
        return Flight(peer, done, count, digest, keep=staging)


@dataclass
class _Pair:
    comm: Any  # cupy's NcclCommunicator (untyped)
    stream: torch.cuda.Stream


class NcclRecvLink:
    """NCCL's part of a GPU receiver (rank 1 of each pair): a communicator per sender, joined
    once its unique id is on the wire; a granted transfer's recvs into staging, scattered
    into the blocks by ``Incoming.finish``."""

    backend = "nccl"

    def __init__(self, kv_layers: list[torch.Tensor]) -> None:
        self._layers = kv_layers  # [num_blocks, 2, block_size, H, D] each, on one GPU
        self._device = kv_layers[0].device
        self._pairs: dict[bytes, _Pair] = {}  # sender identity -> communicator; thread only

    def status(self) -> tuple[bool, str]:
        return cupy_nccl_status()

    def on_hello(self, identity: bytes, hello: w.Hello, session: str) -> Any:
        if hello.gpu and hello.gpu == w.gpu_uuid(self._device):
            return w.Refused(
                f"sender and receiver share GPU {hello.gpu}; NCCL needs one GPU per rank "
                "(on one card use nixl)"
            )
        return w.NcclUniqueId(session, list(_nccl().get_unique_id()))

    def after_reply(self, identity: bytes, reply: Any) -> None:
        if isinstance(reply, w.NcclUniqueId):
            start = time.monotonic()
            comm = _communicator(self._device, 2, reply.unique_id, 1)  # waits for the sender
            stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            self._pairs[identity] = _Pair(comm, stream)
            if (waited := time.monotonic() - start) > 1.0:
                log.warning("nccl receiver: a sender took %.1f s to join", waited)

    def on_begin(self, identity: bytes, begin: w.Begin, incoming: Incoming) -> str | None:
        pair = self._pairs.get(identity)
        if pair is None:
            return "no NCCL communicator with this sender (send Hello first)"
        n = len(begin.dst_block_ids)
        layer = self._layers[0]
        with torch.cuda.stream(pair.stream):
            # [L, n, 2, block_size, H, D]
            staging = torch.empty(
                (len(self._layers), n, *layer.shape[1:]), dtype=layer.dtype, device=self._device
            )
            _group(pair.comm, "recv", list(staging), 0, pair.stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
            event.record(pair.stream)
        incoming.event, incoming.keep = event, staging
        incoming.finish = lambda: self._scatter(pair, staging, begin.dst_block_ids)
        return None

    def _scatter(self, pair: _Pair, staging: torch.Tensor, dst_ids: list[int]) -> None:
        with torch.cuda.stream(pair.stream):
            idx = torch.tensor(dst_ids, dtype=torch.long, device=self._device)
            for layer, blocks in zip(self._layers, staging, strict=True):
                layer.index_copy_(0, idx, blocks)
        pair.stream.synchronize()


def nccl_self_test(device: int = 0, nbytes: int = 256 * 2**20) -> tuple[bool, str, float]:
    """A one-rank communicator sending ``nbytes`` to itself in one group: (bytes equal, detail,
    GB/s). What a single GPU can check of the binding; two ranks need two GPUs."""
    import cupy

    nccl = _nccl()
    dev = torch.device("cuda", device)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.zeros_like(src)
    with cupy.cuda.Device(device):
        comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # untyped in torch
    stream.wait_stream(torch.cuda.current_stream(dev))
    byte = _byte_type(nccl)

    def once() -> float:
        start = time.perf_counter()
        with cupy.cuda.Device(device):
            nccl.groupStart()
            comm.send(src.data_ptr(), nbytes, byte, 0, stream.cuda_stream)
            comm.recv(dst.data_ptr(), nbytes, byte, 0, stream.cuda_stream)
            nccl.groupEnd()
        stream.synchronize()
        return time.perf_counter() - start

    once()  # connection setup
    seconds = min(once() for _ in range(3))
    equal = bool(torch.equal(src, dst))
    version = nccl.get_version()
    return equal, f"NCCL {version}, one rank to itself, {nbytes >> 20} MiB", nbytes / seconds / 1e9
