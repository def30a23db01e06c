"""One worker's NIXL agent: its KV cache registered once, and the peers it may read from.

NVIDIA's NIXL moves memory between agents over UCX (shared memory and CMA between processes on
one host, RDMA or NVLink across them). A worker's cache is registered as one region per layer
(``[num_blocks, 2, block_size, H, D]``, contiguous; host memory ("DRAM") on CPU, "VRAM" on a
GPU) and described once as one descriptor per (layer, block), so a transfer is two lists of
descriptor indices (``prep_xfer_dlist`` once, ``make_prepped_xfer`` per transfer). What a
peer needs to reach the cache (the agent's metadata and the region addresses:
``protocol.messages.KVRegions``) travels at registration over the authenticated control plane
(``Register.kv_regions`` → coordinator → ``KVPeers``); nothing is pickled.

UCX transports: unless the environment sets ``UCX_TLS``, ``UCX_TLS`` below by the memory the
cache is in; on a cluster set ``UCX_TLS`` (``rc,cuda_ipc,cuda_copy,tcp``...) and
``UCX_NET_DEVICES`` (``mlx5_0:1``...) as the README says.
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.kvtransfer import common
from pdserve.kvtransfer.base import LayoutMismatchError, TransferError, check_layouts
from pdserve.protocol.control import KVRegions

log = logging.getLogger("pdserve.kvtransfer.nixl")

# UCX transports by the memory the cache is in, unless the environment sets UCX_TLS: shared
# memory and cross-memory attach between processes on one host, TCP to set up and across
# hosts; GPU memory also needs UCX's CUDA transports (copies, and IPC between local GPUs)
UCX_TLS = {"DRAM": "sm,cma,tcp", "VRAM": "sm,cma,cuda_copy,cuda_ipc,tcp"}
MAX_PEERS = 1024  # agents one worker keeps loaded


def _nixl_api(mem: str) -> Any:  # Any: NIXL's Python API ships no types
    os.environ.setdefault("UCX_TLS", UCX_TLS[mem])  # read by UCX when the agent starts
    missing: ImportError | None = None
    for name in ("nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            missing = exc
    raise TransferError(
        "the nixl backend needs NIXL: pip install nixl-cu13 (make test installs it)"
    ) from missing


@dataclass
class Peer:
    worker_id: str
    regions: KVRegions
    dlist: Any  # the peer's prepared descriptor list (one per layer x block)


def _descriptors(addrs: list[int], block_bytes: int, num_blocks: int, device: int) -> Any:
    """(address, length, device) of every (layer, block), layer-major: index l*n + b."""
    offsets = np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    starts = (np.asarray(addrs, dtype=np.uint64)[:, None] + offsets[None, :]).reshape(-1)
    out = np.empty((starts.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1], out[:, 2] = starts, block_bytes, device
    return out


def indices(block_ids: list[int], num_layers: int, num_blocks: int) -> np.ndarray:
    """Descriptor indices of ``block_ids`` in every layer (layer-major, blocks in order)."""
    ids = np.asarray(block_ids, dtype=np.int64)
    layers = np.arange(num_layers, dtype=np.int64)[:, None] * num_blocks
    return (layers + ids[None, :]).reshape(-1).astype(np.int32)


class NixlAgent:
    """Owns the NIXL agent of one transport: the registered cache (one region per layer), its
    descriptor list, and the loaded peers by worker id. Every call into NIXL holds ``lock``
    (the caller's thread adds peers while the transport's thread transfers)."""

    def __init__(self, kv_layers: list[torch.Tensor], role: str) -> None:
        self.layout = common.layout_of(kv_layers)
        first = kv_layers[0]
        if any(not t.is_contiguous() or t.device != first.device for t in kv_layers):
            raise ValueError("nixl: every KV layer must be contiguous on one device")
        self.mem = "VRAM" if first.device.type == "cuda" else "DRAM"
        device = (first.device.index or 0) if self.mem == "VRAM" else 0
        self.num_blocks = first.shape[0]
        self.block_bytes = first[0].nbytes
        api = _nixl_api(self.mem)
        self.name = f"pdserve-{role}-{os.getpid()}-{secrets.token_hex(4)}"
        self.lock = threading.Lock()
        # no progress thread: NIXL's spins a core (measured: 100% of one per idle worker); the
        # transport's own thread drives progress through its polls (busy only while in flight)
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._agent = api.nixl_agent(self.name, config)
        self._registered = self._agent.register_memory(kv_layers)
        addrs = [t.data_ptr() for t in kv_layers]
        self.first_ptr = addrs[0]
        descs = _descriptors(addrs, self.block_bytes, self.num_blocks, device)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self.mem)
        self.regions = KVRegions(
            agent=self.name,
            metadata=self._agent.get_agent_metadata(),
            mem=self.mem,
            device_id=device,
            layer_addrs=addrs,
            block_bytes=self.block_bytes,
            num_blocks=self.num_blocks,
            layout=self.layout,
        )
        self._peers: dict[str, Peer] = {}
        log.info(
            "nixl agent %s: %d layers x %d blocks of %d bytes in %s",
            self.name,
            len(addrs),
            self.num_blocks,
            self.block_bytes,
            self.mem,
        )

    # ---- peers ---------------------------------------------------------------------------

    def update_peers(self, added: list[tuple[str, KVRegions]], gone: list[str]) -> None:
        """Load peers' regions (replacing what a re-registered worker had) and forget the
        workers in ``gone``; a peer whose cache does not fit this one is refused with a log."""
        with self.lock:
            for worker_id in gone:
                self._forget(worker_id)
            for worker_id, regions in added:
                self._forget(worker_id)
                try:
                    self._load(worker_id, regions)
                except (ValueError, LayoutMismatchError, RuntimeError) as exc:
                    log.warning("nixl: not loading peer %s: %s", worker_id, exc)

    def _load(self, worker_id: str, r: KVRegions) -> None:
        check_layouts(self.layout, r.layout, (self.name, r.agent))
        if r.mem not in ("DRAM", "VRAM") or r.block_bytes != self.block_bytes:
            raise ValueError(f"memory {r.mem!r}, {r.block_bytes} bytes a block")
        if len(r.layer_addrs) != self.layout.num_layers or not 0 < r.num_blocks <= 1 << 24:
            raise ValueError(f"{len(r.layer_addrs)} layer regions of {r.num_blocks} blocks")
        if len(self._peers) >= MAX_PEERS:
            raise ValueError(f"already {MAX_PEERS} peers")
        name = self._agent.add_remote_agent(r.metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != r.agent:
            self._agent.remove_remote_agent(name)
            raise ValueError(f"metadata names agent {name!r}, regions name {r.agent!r}")
        descs = _descriptors(r.layer_addrs, r.block_bytes, r.num_blocks, r.device_id)
        dlist = self._agent.prep_xfer_dlist(r.agent, descs, r.mem)
        self._peers[worker_id] = Peer(worker_id, r, dlist)
        log.info("nixl: loaded peer %s (agent %s)", worker_id, r.agent)

    def _forget(self, worker_id: str) -> None:
        peer = self._peers.pop(worker_id, None)
        if peer is None:
            return
        try:
            self._agent.release_dlist_handle(peer.dlist)
            self._agent.remove_remote_agent(peer.regions.agent)
        except Exception as exc:
            log.warning("nixl: forgetting peer %s: %s", worker_id, exc)
        log.info("nixl: forgot peer %s (agent %s)", worker_id, peer.regions.agent)

    def peer(self, agent: str) -> Peer | None:
        """The loaded peer whose agent is named ``agent``."""
        with self.lock:
            return next((p for p in self._peers.values() if p.regions.agent == agent), None)

    # ---- transfers and notifications --------------------------------------------------------

    def read(self, peer: Peer, local_ids: list[int], remote_ids: list[int], notif: bytes) -> Any:
        """Start reading the peer's ``remote_ids`` into this cache's ``local_ids`` (every
        layer); the peer gets ``notif`` when it completes. Returns the transfer handle."""
        n = self.layout.num_layers
        with self.lock:
            handle = self._agent.make_prepped_xfer(
                "READ",
                self._local,
                indices(local_ids, n, self.num_blocks),
                peer.dlist,
                indices(remote_ids, n, peer.regions.num_blocks),
                notif,
            )
            self._agent.transfer(handle)
        return handle

    def state(self, handle: Any) -> str:
        """ "DONE", "PROC" or "ERR" (a peer that went away is an error, not an exception)."""
        with self.lock:
            try:
                return str(self._agent.check_xfer_state(handle))
            except Exception as exc:
                log.warning("nixl: transfer state: %s", exc)
                return "ERR"

    def release(self, handle: Any) -> bool:
        """Release a transfer handle; False while NIXL cannot (the transfer still runs)."""
        with self.lock:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as exc:
                log.debug("nixl: release deferred: %s", exc)
                return False
        return True

    def notify(self, agent: str, payload: bytes) -> None:
        with self.lock:
            self._agent.send_notif(agent, payload)

    def notifications(self) -> list[tuple[str, bytes]]:
        """(sender agent, payload) of every notification that arrived since the last call."""
        with self.lock:
            new = self._agent.get_new_notifs()
        out: list[tuple[str, bytes]] = []
        for agent, payloads in new.items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            out.extend((name, bytes(p)) for p in payloads)
        return out

    def close(self) -> None:
        with self.lock:
            for worker_id in list(self._peers):
                self._forget(worker_id)
            try:
                self._agent.release_dlist_handle(self._local)
                self._agent.deregister_memory(self._registered)
            except Exception as exc:
                log.warning("nixl: closing agent %s: %s", self.name, exc)
