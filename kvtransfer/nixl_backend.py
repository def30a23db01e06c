"""KV transfer over NIXL, pull: the decode worker reads the blocks the prefill worker offers
(this module: the sender and the wire; ``nixl_receiver``: the reader).

::

    prefill (sender)                                    decode (receiver)
    send(spec): offer ── KVHeader (notification:  ──▶   expect(rid, dst) ... offer arrives:
                         src ids, dst ids, secret,      secret and header checked, then READ
                         checksum)                      peer[src ids] ─▶ cache[dst ids]
    DONE: the blocks may be freed  ◀── KVAck (sent by NIXL when the READ completes) ──
                                                        DONE (checksum checked, when one came)

Pull, as vLLM's NixlConnector does it, because the decode worker then owns every write into
its cache: a late, duplicate or forged offer can never land in blocks it has freed and given to
another request, and a transfer it gives up on (deadline, abort) is cancelled by the side whose
memory it writes. The prefill worker's blocks are held on a lease (the transfer's
``timeout_s``): a decode worker that dies mid-read never strands them.

Agents' metadata and region layouts are exchanged at registration (``nixl_agent``), so an
offer is one small notification and a read is two lists of descriptor indices.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, replace
from typing import Any

import torch

from pdserve.kvtransfer import common, table
from pdserve.kvtransfer.base import KVPoll, KVSender, TransferError, TransferSpec
from pdserve.kvtransfer.faults import FaultDice, FaultPlan
from pdserve.kvtransfer.nixl_agent import NixlAgent
from pdserve.protocol.control import KVRegions
from pdserve.protocol.messages import KVHeader, ProtocolError, decode, encode
from pdserve.protocol.transfer import KVAck

log = logging.getLogger("pdserve.kvtransfer.nixl")

ADDRESS_PREFIX = "nixl://"  # + the receiver's agent name
BUSY_S = 0.0005  # notification polling while transfers are in flight
IDLE_S = 0.02


def message(payload: bytes) -> Any:
    return decode([payload])


def single_frame(msg: KVHeader | KVAck) -> bytes:
    frames = encode(msg)
    if len(frames) != 1:
        raise ProtocolError(f"{type(msg).__name__} does not fit one notification")
    return frames[0]


# ---- sender (prefill) ----------------------------------------------------------------------


@dataclass
class _Offer:
    spec: TransferSpec
    header: KVHeader
    fault: str | None = None
    not_before: float = 0.0


class NixlKVSender(table.TableBacked, KVSender):
    """Offers blocks of the registered cache to decode workers and holds them until the reader
    acknowledges or the lease (``timeout_s``) ends."""

    def __init__(
        self,
        *,
        kv_layers: list[torch.Tensor],
        checksum: bool = False,
        fault: FaultPlan | None = None,
    ) -> None:
        self.checksum = checksum
        self._nixl = NixlAgent(kv_layers, "prefill")
        self._table = table.TransferTable("nixl sender")
        self._dice = FaultDice(fault) if fault is not None else None
        self._jobs: queue.SimpleQueue[_Offer] = queue.SimpleQueue()
        self._offered: dict[str, str] = {}  # request id -> the reader's agent
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-nixl-sender", daemon=True)
        self._thread.start()

    @property
    def regions(self) -> KVRegions:
        return self._nixl.regions

    def update_peers(self, added: list[tuple[str, KVRegions]], gone: list[str]) -> None:
        self._nixl.update_peers(added, gone)

    def send(self, spec: TransferSpec, kv_layers: list[torch.Tensor]) -> None:
        if self._stop.is_set():
            raise TransferError("nixl sender is closed")
        if kv_layers[0].data_ptr() != self._nixl.first_ptr:
            raise ValueError(f"transfer {spec.request_id!r}: not the registered KV cache")
        common.check_block_ids(spec.src_block_ids, self._nixl.num_blocks, spec.request_id)
        offer = _Offer(spec, self._header(spec, kv_layers))
        self._table.add(spec.request_id, spec.timeout_s, spec.src_block_ids)
        if self._dice is not None:
            self._dice.mark(offer)
        self._jobs.put(offer)
        self._wake.set()

    def _header(self, spec: TransferSpec, kv_layers: list[torch.Tensor]) -> KVHeader:
        crc = None
        if self.checksum:
            staged = [t.cpu() for t in common.gather(kv_layers, spec.src_block_ids)]
            crc = common.checksum([common.as_bytes(t) for t in staged])
        return KVHeader(
            request_id=spec.request_id,
            dst_block_ids=list(spec.dst_block_ids),
            src_block_ids=list(spec.src_block_ids),
            num_layers=len(kv_layers),
            dtype=common.dtype_name(kv_layers[0].dtype),
            block_shape=list(kv_layers[0].shape[1:]),
            checksum=crc,
            secret=spec.secret,
        )

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._nixl.close()

    # ---- sender thread -----------------------------------------------------------------------

    def _run(self) -> None:
        waiting: list[_Offer] = []  # not offered yet: delayed, or the reader is not loaded yet
        while not self._stop.is_set():
            self._wake.wait(BUSY_S if self._offered or waiting else IDLE_S)
            self._wake.clear()
            while not self._jobs.empty():
                waiting.append(self._jobs.get_nowait())
            waiting = [job for job in waiting if not self._offer(job)]
            try:
                for agent, payload in self._nixl.notifications():
                    self._acknowledged(agent, payload)
            except Exception:  # a bad notification must never stop the sender
                log.exception("nixl sender: reading notifications")
            for rid in self._table.expire():  # the lease ended: the blocks go back
                self._offered.pop(rid, None)

    def _offer(self, job: _Offer) -> bool:
        """Notify the reader of one transfer; False to retry it later."""
        rid = job.spec.request_id
        state = table.gate(self._table, rid, job)
        if state is not table.JobGate.GO:
            return state is table.JobGate.OVER
        agent = job.spec.address.removeprefix(ADDRESS_PREFIX)
        if self._nixl.peer(agent) is None:
            return False  # its regions have not reached us yet: wait, up to the lease
        try:
            self._nixl.notify(agent, single_frame(_faulty(job, self._nixl.num_blocks)))
        except Exception as exc:
            self._table.advance(rid, KVPoll.FAILED, f"cannot offer to {agent}: {exc}")
            return True
        if self._table.advance(rid, KVPoll.TRANSFERRING):
            self._offered[rid] = agent
        return True

    def _acknowledged(self, agent: str, payload: bytes) -> None:
        try:
            ack = message(payload)
        except ProtocolError as exc:
            log.warning("nixl sender: dropped a bad notification from %s: %s", agent, exc)
            return
        if not isinstance(ack, KVAck) or self._offered.get(ack.request_id) != agent:
            log.warning("nixl sender: dropped an acknowledgement %r from %s", payload[:64], agent)
            return
        del self._offered[ack.request_id]
        state = KVPoll.DONE if ack.ok else KVPoll.FAILED
        self._table.advance(ack.request_id, state, None if ack.ok else f"reader: {ack.reason}")


def _faulty(job: _Offer, num_blocks: int) -> KVHeader:
    """The offer as a faulty sender makes it (after the checksum was taken)."""
    h = job.header
    if job.fault == "truncate":
        log.warning("injected fault: truncating transfer %r", h.request_id)
        return replace(h, src_block_ids=h.src_block_ids[:-1])
    if job.fault == "corrupt":  # the reader reads one block from the wrong place
        log.warning("injected fault: corrupting transfer %r", h.request_id)
        src = list(h.src_block_ids)
        src[-1] = (src[-1] + 1) % num_blocks
        return replace(h, src_block_ids=src)
    return h
