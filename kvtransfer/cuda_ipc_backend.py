"""Same-node GPU to GPU KV transfer through CUDA IPC: the prefill worker copies straight into
the decode worker's KV blocks, no host memory on the way.

    decode (receiver)                              prefill (sender)
    Hello ◀──────────────────────────────────────  first transfer to this address
    IpcHandles: every KV layer shared through ───▶ opened once (rebuild_cuda_tensor), on this
    torch's reduce_tensor (handle + offsets)        process's index of the receiver's GPU
    Begin ⇄ BeginReply(ok)                          per layer, on a side stream:
                                                      dst[l][dst_ids] = src[l][src_ids]
                                                    (one copy per run of consecutive ids)
    Done(rid, layers, checksum) ◀────────────────  once the copies' event completes

The handshake and checks are ``gpu_sender`` / ``gpu_receiver``; the messages ``gpu_wire``.
CUDA IPC handles cannot be opened by the process that exported them: the two ends must be
different processes on one node (pdserve's prefill and decode workers are). A copy already
granted cannot be recalled: ``release`` waits up to ``RELEASE_GRACE_S`` for it to land.

NOT yet run on a GPU; ``bench/micro/gpu.py`` checks tokens through it and measures its bandwidth.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from pdserve.engine.platform import cuda_ipc_status
from pdserve.kvtransfer import gpu_wire as w
from pdserve.kvtransfer.base import TransferError
from pdserve.kvtransfer.gpu_receiver import GpuKVReceiver
from pdserve.kvtransfer.gpu_sender import Flight, GpuKVSender, Job, Peer, round_trip, sender_hello

MAX_RUNS = 32  # more runs than this per transfer: gather + scatter instead of run copies


class CudaIpcKVSender(GpuKVSender):
    backend = "cuda_ipc"
    status = staticmethod(cuda_ipc_status)

    def _connect(self, address: str, job: Job, deadline: float) -> Peer:
        sock = self._dealer(address)
        try:
            reply = round_trip(sock, sender_hello(self.backend, job), w.IpcHandles, deadline)
            layers = self._open(reply, job)
        except BaseException:
            sock.close(linger=0)
            raise
        return Peer(address, sock, reply.session, data=layers)

    def _open(self, reply: w.IpcHandles, job: Job) -> list[torch.Tensor]:
        if reply.pid == os.getpid():
            raise TransferError(
                "the receiver is in this process; CUDA IPC handles cannot be opened by the "
                "process that exported them (use another backend in one process)"
            )
        if len(reply.layers) != len(job.layers):
            raise TransferError(
                f"receiver shared {len(reply.layers)} layers, not {len(job.layers)}"
            )
        device = w.local_device_for(reply.gpu, reply.layers[0].device)
        if device is None:
            raise TransferError(
                f"the receiver's GPU {reply.gpu} is not visible in this process "
                "(another node, or hidden by CUDA_VISIBLE_DEVICES)"
            )
        layers = [w.open_tensor(t, device) for t in reply.layers]
        src = job.layers[0]
        if any(t.shape[1:] != src.shape[1:] or t.dtype != src.dtype for t in layers):
            raise TransferError("the receiver's KV blocks differ from ours in shape or dtype")
        return layers

    def _issue(self, peer: Peer, job: Job, stream: torch.cuda.Stream) -> Flight:
        dst_layers: list[torch.Tensor] = peer.data
        digest = self._source_digest(job)
        count = len(job.layers) - (job.fault == "truncate")
        src_ids, dst_ids = job.spec.src_block_ids, job.spec.dst_block_ids
        if dst_layers[0].device == job.layers[0].device:
            copy_blocks(job.layers[:count], dst_layers, src_ids, dst_ids)
            keep = None
            if job.fault == "corrupt":
                _flip_a_byte(dst_layers[0][dst_ids[0]])
            done = torch.cuda.Event()
            done.record(stream)
        else:
            done, keep = self._peer_copy(job, dst_layers, count, stream)
        return Flight(peer, done, count, digest, keep=keep)

    def _peer_copy(
        self, job: Job, dst_layers: list[torch.Tensor], count: int, stream: torch.cuda.Stream
    ) -> tuple[torch.cuda.Event, Any]:
        """Another GPU of this node: gather here, then peer copies and the scatter on the
        destination GPU's side stream."""
        dst_dev = dst_layers[0].device
        src_idx = torch.tensor(job.spec.src_block_ids, dtype=torch.long, device=stream.device)
        staged = [job.layers[i].index_select(0, src_idx) for i in range(count)]
        gathered = torch.cuda.Event()
        gathered.record(stream)
        dst_stream = self._stream(dst_dev)
        dst_stream.wait_event(gathered)
        with torch.cuda.stream(dst_stream):
            dst_idx = torch.tensor(job.spec.dst_block_ids, dtype=torch.long, device=dst_dev)
            for i, blocks in enumerate(staged):
                dst_layers[i].index_copy_(0, dst_idx, blocks.to(dst_dev, non_blocking=True))
            if job.fault == "corrupt":
                _flip_a_byte(dst_layers[0][job.spec.dst_block_ids[0]])
            done = torch.cuda.Event()
            done.record(dst_stream)
        return done, (staged, src_idx, dst_idx)


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of each stretch where both id lists run on by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
    max_runs: int = MAX_RUNS,
) -> None:
    """dst[l][dst_ids[i]] = src[l][src_ids[i]] for every layer given, on the current stream.

    Blocks are usually allocated in order, so a transfer is a few contiguous runs: one
    device-to-device copy each (each byte read and written once). Scattered ids take one
    gather and one scatter per layer instead (each byte moved twice)."""
    runs = block_runs(src_ids, dst_ids)
    if len(runs) <= max_runs:
        for src, dst in zip(src_layers, dst_layers, strict=False):
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
        return
    src_idx = torch.tensor(src_ids, dtype=torch.long, device=src_layers[0].device)
    dst_idx = torch.tensor(dst_ids, dtype=torch.long, device=dst_layers[0].device)
    for src, dst in zip(src_layers, dst_layers, strict=False):
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))


def _flip_a_byte(block: torch.Tensor) -> None:
    """Injected ``corrupt`` fault: one byte of the landed KV, after the checksum was taken."""
    block.view(-1).view(torch.uint8)[:1].bitwise_xor_(0xFF)


class CudaIpcKVReceiver(GpuKVReceiver):
    backend = "cuda_ipc"
    status = staticmethod(cuda_ipc_status)
    wait_on_release = True

    def _on_hello(self, identity: bytes, hello: w.Hello) -> Any:
        # shared afresh for each sender: each opener gives back one reference of torch's
        # IPC ref counter when it closes the mapping
        return w.IpcHandles(
            self.session, os.getpid(), self._gpu, [w.export_tensor(t) for t in self._layers]
        )
