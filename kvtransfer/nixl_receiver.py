"""The NIXL reader (decode side): checks an offer, reads the offered blocks into the ones it
expects, and tells the sender when the read is over (``nixl_backend`` has the whole picture)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kvtransfer import common, table
from pdserve.kvtransfer.base import KVPoll, KVReceiver
from pdserve.kvtransfer.nixl_agent import NixlAgent
from pdserve.kvtransfer.nixl_backend import ADDRESS_PREFIX, BUSY_S, IDLE_S, message, single_frame
from pdserve.protocol.control import KVRegions
from pdserve.protocol.messages import KVHeader, ProtocolError
from pdserve.protocol.transfer import KVAck

log = logging.getLogger("pdserve.kvtransfer.nixl")

_ABORT_WAIT_S = 10.0  # how long ``release`` waits for NIXL to give up a running read


@dataclass
class _Read:
    entry: table.Entry
    header: KVHeader
    agent: str
    handle: Any
    deadline: float


class NixlKVReceiver(table.TableBackedReceiver, KVReceiver):
    """Reads offered blocks into the blocks it expects; a read in flight keeps its entry out of
    the table's expiry (its own deadline is enforced here, by cancelling it first)."""

    def __init__(
        self,
        kv_layers: list[torch.Tensor],
        bind: str | None = None,  # unused: NIXL listens through UCX
        *,
        require_checksum: bool = False,
    ) -> None:
        self._nixl = NixlAgent(kv_layers, "decode")
        self._layout = self._nixl.layout
        self._init_receiver("nixl", kv_layers, require_checksum)
        self._reads: dict[str, _Read] = {}
        self._unready: list[tuple[str, bytes]] = []  # offers from peers not loaded yet
        self._start_thread("nixl", ADDRESS_PREFIX + self._nixl.name)

    @property
    def regions(self) -> KVRegions:
        return self._nixl.regions

    def update_peers(self, added: list[tuple[str, KVRegions]], gone: list[str]) -> None:
        self._nixl.update_peers(added, gone)

    def release(self, request_id: str) -> None:
        with self._table.lock:
            self._table.pop(request_id)
            read = self._reads.pop(request_id, None)
        if read is not None:  # its blocks are about to be reused: the read must be over
            self._cancel(read)

    def close(self) -> None:
        if not self._stop_thread():
            return
        for read in list(self._reads.values()):
            self._cancel(read)
        self._nixl.close()

    def _cancel(self, read: _Read) -> None:
        give_up = time.monotonic() + _ABORT_WAIT_S
        while not self._nixl.release(read.handle):
            if time.monotonic() > give_up:
                log.error("nixl receiver: read %r would not stop", read.header.request_id)
                return
            time.sleep(0.001)

    # ---- receiver thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(BUSY_S if self._reads or self._unready else IDLE_S):
            try:
                offers = self._unready + self._nixl.notifications()
                self._unready = []
                for agent, payload in offers:
                    self._offered(agent, payload)
                self._progress()
            except Exception:  # a bad transfer must never kill the receiver
                log.exception("nixl receiver: unexpected error")
            self._table.expire()

    def _offered(self, agent: str, payload: bytes) -> None:
        try:
            header = message(payload)
        except ProtocolError as exc:
            log.warning("nixl receiver: dropped a bad offer from %s: %s", agent, exc)
            return
        if not isinstance(header, KVHeader):
            log.warning("nixl receiver: dropped a %s from %s", type(header).__name__, agent)
            return
        rid = header.request_id
        with self._table.lock:
            entry = self._pending(rid, header.secret, "an offer")
            if entry is None:
                return
            peer = self._nixl.peer(agent)
            if peer is None:  # registered after its first offer left: wait for its regions
                self._unready.append((agent, payload))
                return
            problem = self._problem(header, entry, peer.regions.num_blocks)
            if problem is not None:
                self._table.advance(rid, KVPoll.FAILED, problem)
                self._ack(agent, rid, problem)
                return
            deadline, entry.deadline = entry.deadline, math.inf  # ours now (see the class)
            self._table.advance(rid, KVPoll.TRANSFERRING)
            done = single_frame(KVAck(request_id=rid, ok=True))
            try:
                handle = self._nixl.read(peer, entry.block_ids, header.src_block_ids, done)
            except Exception as exc:
                self._table.advance(rid, KVPoll.FAILED, f"cannot read from {agent}: {exc}")
                self._ack(agent, rid, "read not started")
                return
            self._reads[rid] = _Read(entry, header, agent, handle, deadline)

    def _problem(self, h: KVHeader, entry: table.Entry, peer_blocks: int) -> str | None:
        problem = common.header_problem(h, self._layout, entry.block_ids, self.require_checksum)
        if problem is None and len(h.src_block_ids) != len(h.dst_block_ids):
            problem = f"{len(h.src_block_ids)} source blocks offered for {len(h.dst_block_ids)}"
        if problem is None and any(not 0 <= b < peer_blocks for b in h.src_block_ids):
            problem = "source blocks outside the sender's cache"
        return problem

    def _progress(self) -> None:
        """Finish the reads that completed, failed, or ran past their deadline."""
        now = time.monotonic()
        for rid, read in list(self._reads.items()):
            state = self._nixl.state(read.handle)
            if state == "PROC" and now < read.deadline:
                continue
            if not self._nixl.release(read.handle):
                continue  # still running: NIXL cannot cancel it yet; try again next turn
            with self._table.lock:
                if self._reads.get(rid) is not read:
                    continue  # released by its owner meanwhile
                del self._reads[rid]
                reason = {"PROC": "timed out", "ERR": "read failed (the sender went away?)"}
                problem = reason.get(state) or self._checksum_problem(read)
                final = KVPoll.FAILED if problem else KVPoll.DONE
                self._table.advance(rid, final, problem)
            if state != "DONE":
                self._ack(read.agent, rid, problem or "failed")

    def _checksum_problem(self, read: _Read) -> str | None:
        if read.header.checksum is None:
            return None
        staged = [t.cpu() for t in common.gather(self._layers, read.entry.block_ids)]
        if common.checksum([common.as_bytes(t) for t in staged]) != read.header.checksum:
            return "checksum mismatch"
        return None

    def _ack(self, agent: str, rid: str, reason: str) -> None:
        """Tell the sender a transfer failed here, so its lease ends now (best effort)."""
        try:
            self._nixl.notify(agent, single_frame(KVAck(request_id=rid, ok=False, reason=reason)))
        except Exception as exc:
            log.debug("nixl receiver: cannot tell %s about %r: %s", agent, rid, exc)
