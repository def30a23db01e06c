"""Introducing workers to each other for one-sided KV transports (NIXL).

A worker whose ``Register`` carries ``kv_regions`` (where its KV cache lives, with its
transport agent's metadata) is announced to every registered worker of its model that can be
its other end (a prefill worker's readers are decode workers, and the other way round; a
colocated worker is both), and learns theirs in one ``KVPeers``; a worker that dies or restarts
is announced as gone. All of it rides the authenticated control plane at registration, so the
first request's transfer finds its peer loaded.
"""

from __future__ import annotations

from pdserve.coordinator.registry import Worker
from pdserve.coordinator.routes import Shared
from pdserve.protocol.control import Register
from pdserve.protocol.transfer import KVPeer, KVPeers


def _pairs(a: Register, b: Register) -> bool:
    """Whether KV may move between ``a`` and ``b``: same model, one prefills, one decodes."""
    if a.model != b.model or a.kv_regions is None or b.kv_regions is None:
        return False
    return (a.role == "prefill") != (b.role == "prefill")  # a colocated worker only reads


def _peer(info: Register) -> KVPeer:
    assert info.kv_regions is not None
    return KVPeer(worker_id=info.worker_id, regions=info.kv_regions)


class TransferPeers:
    """Owns who has been told about whose KV regions (nothing to hold: the registry is the
    list, each message is complete)."""

    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def joined(self, info: Register) -> None:
        """``info`` registered (first time, or changed): tell it and its peers."""
        if info.kv_regions is None:
            return
        others = [w for w in self.shared.registry.workers.values() if _pairs(info, w.info)]
        for other in others:
            self._send(other, KVPeers(added=[_peer(info)]))
        new = self.shared.registry.workers.get(info.worker_id)
        if new is not None and others:
            self._send(new, KVPeers(added=[_peer(o.info) for o in others]))

    def left(self, gone: Register) -> None:
        """``gone`` died or restarted: its peers forget it (and re-load it if it returns)."""
        if gone.kv_regions is None:
            return
        for other in self.shared.registry.workers.values():
            if _pairs(gone, other.info):
                self._send(other, KVPeers(gone=[gone.worker_id]))

    def _send(self, worker: Worker, msg: KVPeers) -> None:
        self.shared.outbox.to_worker(worker.worker_id, worker.info.control_address, msg)
