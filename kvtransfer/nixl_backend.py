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

In parts (``send_part``; the prefill worker's ``--kv-stream-chunks``): a long prompt's blocks
are offered as its chunks complete, each offer with the next ``KVHeader.part`` and its own
checksum and injected fault, the last one ``last``; the reader starts each read as its offer
comes and acknowledges each (``KVAck.part``); the transfer is DONE when every offer was read,
and the blocks of all of them are held until then (the lease runs from the latest offer)::

    send_part(blocks 0-7) ── part 0 ──▶ READ 0-7   ─ KVAck 0 ─▶
    send_part(blocks 8-15) ─ part 1 ──▶ READ 8-15  ─ KVAck 1 ─▶
    send_part(16-17, last) ─ part 2 ──▶ READ 16-17 ─ KVAck 2 ─▶ DONE (every part read)

A transfer's parts leave in order (one held back by an injected delay holds back the rest).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pdserve.kvtransfer import common
from pdserve.kvtransfer.base import KVPoll, KVSender, TransferError, TransferSpec
from pdserve.kvtransfer.faults import FaultDice, FaultPlan
from pdserve.kvtransfer.nixl_agent import NixlAgent
from pdserve.kvtransfer.table import JobGate, TransferTable, gate
from pdserve.kvtransfer.threads import SenderThread
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


@dataclass
class _Opened:
    """A transfer offered in parts, on the caller's side: its reader, the next part's index."""

    address: str
    secret: bytes
    next_part: int = 1


@dataclass
class _Sent:
    """A transfer on the sender's thread: its reader, the offers made and those read, and how
    many offers there are in all once the last one was made."""

    agent: str
    offered: int = 0
    read: set[int] = field(default_factory=set)
    parts: int | None = None


class NixlKVSender(KVSender):
    """Offers blocks of the registered cache to decode workers (at once or in parts) and holds
    them until the reader acknowledges every offer or the lease (``timeout_s``) ends. Parts:
    ``_nixl`` (agent, peers), ``_table``, ``_thread`` (and its offers), ``_dice`` (faults)."""

    sends_parts = True

    def __init__(
        self,
        *,
        kv_layers: list[torch.Tensor],
        checksum: bool = False,
        fault: FaultPlan | None = None,
    ) -> None:
        self.checksum = checksum
        self._nixl = NixlAgent(kv_layers, "prefill")
        self._table = TransferTable("nixl sender")
        self._dice = FaultDice(fault) if fault is not None else None
        self._opened: dict[str, _Opened] = {}  # transfers in parts, the last still to come
        self._sent: dict[str, _Sent] = {}  # the sender thread's: transfers offered, by id
        self._thread: SenderThread[_Offer] = SenderThread("kv-nixl-sender")
        self._thread.start(self._run)

    @property
    def regions(self) -> KVRegions:
        return self._nixl.regions

    def update_peers(self, added: list[tuple[str, KVRegions]], gone: list[str]) -> None:
        self._nixl.update_peers(added, gone)

    def send(self, spec: TransferSpec, kv_layers: list[torch.Tensor]) -> None:
        self.send_part(spec, kv_layers, last=True)

    def send_part(self, spec: TransferSpec, kv_layers: list[torch.Tensor], last: bool) -> None:
        if not self._thread.running:
            raise TransferError("nixl sender is closed")
        if kv_layers[0].data_ptr() != self._nixl.first_ptr:
            raise ValueError(f"transfer {spec.request_id!r}: not the registered KV cache")
        common.check_block_ids(spec.src_block_ids, self._nixl.num_blocks, spec.request_id)
        if self._nixl.mem == "VRAM":  # the step's kernels may still be writing these blocks
            torch.cuda.synchronize(kv_layers[0].device)
        part = self._next_part(spec, last)
        if part is None:
            return
        offer = _Offer(spec, self._header(spec, kv_layers, part, last))
        if self._dice is not None:
            self._dice.mark(offer)
        self._thread.put(offer)

    def _next_part(self, spec: TransferSpec, last: bool) -> int | None:
        """This offer's part index (part 0 opens the transfer in the table); None when the
        transfer has finished already (failed, or dropped by a fault): nothing more goes."""
        rid = spec.request_id
        opened = self._opened.get(rid)
        if opened is None:
            self._table.add(rid, spec.timeout_s, spec.src_block_ids)  # ValueError: in use
            if not last:
                self._opened[rid] = _Opened(spec.address, spec.secret)
            return 0
        if (spec.address, spec.secret) != (opened.address, opened.secret):
            raise ValueError(f"transfer {rid!r}: a part for another receiver")
        part, opened.next_part = opened.next_part, opened.next_part + 1
        if last:
            del self._opened[rid]
        return part if self._table.extend(rid, spec.timeout_s, spec.src_block_ids) else None

    def poll(self, request_id: str) -> KVPoll:
        return self._table.poll(request_id)

    def failure_reason(self, request_id: str) -> str | None:
        return self._table.reason(request_id)

    def release(self, request_id: str) -> None:
        self._opened.pop(request_id, None)
        self._table.pop(request_id)

    def notify(self, callback: Callable[[str, KVPoll], None] | None) -> None:
        self._table.on_finished = callback

    def _header(
        self, spec: TransferSpec, kv_layers: list[torch.Tensor], part: int, last: bool
    ) -> KVHeader:
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
            part=part,
            last=last,
        )

    def close(self) -> None:
        if self._thread.stop():
            self._nixl.close()

    # ---- sender thread -----------------------------------------------------------------------

    def _run(self) -> None:
        waiting: list[_Offer] = []  # not offered yet: delayed, or the reader is not loaded yet
        while self._thread.running:
            # polled fast while a read may end; between a transfer's parts, a part wakes it
            reading = any(len(s.read) < s.offered for s in self._sent.values())
            self._thread.wait(BUSY_S if reading or waiting else IDLE_S)
            waiting += self._thread.take()
            waiting = self._offer_in_order(waiting)
            try:
                for agent, payload in self._nixl.notifications():
                    self._acknowledged(agent, payload)
            except Exception:  # a bad notification must never stop the sender
                log.exception("nixl sender: reading notifications")
            self._table.expire()  # the lease ended: the blocks go back
            for rid in [r for r in self._sent if not self._open(r)]:
                del self._sent[rid]

    def _open(self, request_id: str) -> bool:
        entry = self._table.get(request_id)
        return entry is not None and not entry.state.finished

    def _offer_in_order(self, jobs: list[_Offer]) -> list[_Offer]:
        """Offer what may go now, each transfer's parts in order (behind a part that waits,
        the later ones wait too); returns the jobs still waiting."""
        left: list[_Offer] = []
        held: set[str] = set()
        for job in jobs:
            rid = job.spec.request_id
            if rid in held or not self._offer(job):
                held.add(rid)
                left.append(job)
        return left

    def _offer(self, job: _Offer) -> bool:
        """Notify the reader of one transfer; False to retry it later."""
        rid = job.spec.request_id
        state = gate(self._table, rid, job)
        if state is not JobGate.GO:
            return state is JobGate.OVER
        agent = job.spec.address.removeprefix(ADDRESS_PREFIX)
        if self._nixl.peer(agent) is None:
            return False  # its regions have not reached us yet: wait, up to the lease
        try:
            self._nixl.notify(agent, single_frame(_faulty(job, self._nixl.num_blocks)))
        except Exception as exc:
            self._table.advance(rid, KVPoll.FAILED, f"cannot offer to {agent}: {exc}")
            return True
        if self._table.advance(rid, KVPoll.TRANSFERRING):
            if job.header.part == 0:
                self._sent[rid] = _Sent(agent)
            sent = self._sent.get(rid)
            if sent is not None:
                sent.offered += 1
                if job.header.last:
                    sent.parts = job.header.part + 1
        return True

    def _acknowledged(self, agent: str, payload: bytes) -> None:
        try:
            ack = message(payload)
        except ProtocolError as exc:
            log.warning("nixl sender: dropped a bad notification from %s: %s", agent, exc)
            return
        sent = self._sent.get(ack.request_id) if isinstance(ack, KVAck) else None
        if not isinstance(ack, KVAck) or sent is None or sent.agent != agent:
            log.warning("nixl sender: dropped an acknowledgement %r from %s", payload[:64], agent)
            return
        rid = ack.request_id
        if not ack.ok:
            del self._sent[rid]
            self._table.advance(rid, KVPoll.FAILED, f"reader: {ack.reason}")
            return
        if not 0 <= ack.part < sent.offered or ack.part in sent.read:
            log.warning("nixl sender: dropped an acknowledgement of offer %d of %r", ack.part, rid)
            return
        sent.read.add(ack.part)
        if len(sent.read) == sent.parts:  # every offer was read
            del self._sent[rid]
            self._table.advance(rid, KVPoll.DONE)


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
