"""The NIXL reader (decode side): checks an offer, reads the offered blocks into the ones it
expects, and tells the sender when the read is over (``nixl_backend`` has the whole picture).

A transfer offered in parts is one ``_Stream``: each offer must be the next part, with the
reservation's secret, from the agent of the first, its blocks the ones after the previous
part's; its read starts at once, beside those still running. The transfer is DONE when the
last part came and every read ended well; FAILED, with every read of it stopped first, at
the first problem (a bad offer, a failed read, a checksum, the deadline)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.kvtransfer import common
from pdserve.kvtransfer.base import DEFAULT_TIMEOUT_S, KVPoll, KVReceiver
from pdserve.kvtransfer.nixl_agent import NixlAgent
from pdserve.kvtransfer.nixl_backend import ADDRESS_PREFIX, BUSY_S, IDLE_S, message, single_frame
from pdserve.kvtransfer.table import Entry, Reservations, TransferTable, secret_matches
from pdserve.kvtransfer.threads import LoopThread
from pdserve.protocol.control import KVRegions
from pdserve.protocol.messages import KVHeader, ProtocolError
from pdserve.protocol.transfer import KVAck

log = logging.getLogger("pdserve.kvtransfer.nixl")

_ABORT_WAIT_S = 10.0  # how long ``release`` waits for NIXL to give up a running read


@dataclass
class _Read:
    header: KVHeader  # one offer
    handle: Any


@dataclass
class _Stream:
    """One transfer's offers here: where the next one's blocks start, its reads in flight, and
    why it fails (set: its reads are being stopped, then it is FAILED)."""

    entry: Entry
    agent: str
    deadline: float
    next_part: int = 0
    offset: int = 0  # the expected blocks offered so far
    complete: bool = False  # the last part came
    reads: list[_Read] = field(default_factory=list)
    read_ok: int = 0  # reads that ended well
    problem: str | None = None


class NixlKVReceiver(KVReceiver):
    """Reads offered blocks into the blocks it expects; from the first offer on, a transfer's
    entry is out of the table's expiry (its deadline is enforced here, reads stopped first).

    Parts: ``_nixl`` (the agent and its peers), ``_table`` (the transfers), ``_reservations``
    (``expect`` and the secret an offer must present), ``_thread`` (the reader thread)."""

    def __init__(
        self,
        kv_layers: list[torch.Tensor],
        bind: str | None = None,  # unused: NIXL listens through UCX
        *,
        require_checksum: bool = False,
    ) -> None:
        self._nixl = NixlAgent(kv_layers, "decode")
        self._layout = self._nixl.layout
        self._layers = kv_layers
        self.require_checksum = require_checksum
        self._table = TransferTable("nixl receiver")
        self._reservations = Reservations(self._table, self._nixl.num_blocks)
        self._streams: dict[str, _Stream] = {}  # transfers offered, by request id
        self._unready: list[tuple[str, bytes]] = []  # offers from peers not loaded yet
        self._thread = LoopThread("kv-nixl-receiver")
        self._thread.start(self._run)

    @property
    def address(self) -> str:
        return ADDRESS_PREFIX + self._nixl.name

    @property
    def regions(self) -> KVRegions:
        return self._nixl.regions

    def update_peers(self, added: list[tuple[str, KVRegions]], gone: list[str]) -> None:
        self._nixl.update_peers(added, gone)

    def expect(
        self, request_id: str, dst_block_ids: list[int], timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> bytes:
        return self._reservations.expect(request_id, dst_block_ids, timeout_s)

    def poll(self, request_id: str) -> KVPoll:
        return self._table.poll(request_id)

    def failure_reason(self, request_id: str) -> str | None:
        return self._table.reason(request_id)

    def release(self, request_id: str) -> None:
        with self._table.lock:
            self._table.pop(request_id)
            stream = self._streams.pop(request_id, None)
        for read in stream.reads if stream is not None else []:
            self._cancel(read)  # its blocks are about to be reused: the read must be over

    def close(self) -> None:
        if not self._thread.stop():
            return
        for stream in list(self._streams.values()):
            for read in stream.reads:
                self._cancel(read)
        self._nixl.close()

    def _cancel(self, read: _Read) -> None:
        give_up = time.monotonic() + _ABORT_WAIT_S
        while not self._nixl.release(read.handle):
            if time.monotonic() > give_up:
                log.error("nixl receiver: a read of %r would not stop", read.header.request_id)
                return
            time.sleep(0.001)

    # ---- receiver thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while self._thread.idle(BUSY_S if self._busy() else IDLE_S):
            try:
                offers = self._unready + self._nixl.notifications()
                self._unready = []
                for agent, payload in offers:
                    self._offered(agent, payload)
                self._progress()
            except Exception:  # a bad transfer must never kill the receiver
                log.exception("nixl receiver: unexpected error")
            self._table.expire()

    def _busy(self) -> bool:
        """Polled fast while a read runs or an offer waits; between parts (the prefill worker
        computing its next chunk), as when idle: an offer is a notification away anyway."""
        return bool(self._unready) or any(s.reads for s in list(self._streams.values()))

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
            stream = self._stream_for(agent, header, payload)
            if stream is None:
                return
            peer = self._nixl.peer(agent)
            problem = (
                "the sender left"
                if peer is None
                else self._problem(header, stream, peer.regions.num_blocks)
            )
            if problem is not None or peer is None:
                stream.problem = problem
                return
            stream.next_part += 1
            stream.offset += len(header.dst_block_ids)
            stream.complete = header.last
            done = single_frame(KVAck(request_id=rid, ok=True, part=header.part))
            try:
                handle = self._nixl.read(peer, header.dst_block_ids, header.src_block_ids, done)
            except Exception as exc:
                stream.problem = f"cannot read from {agent}: {exc}"
                return
            stream.reads.append(_Read(header, handle))

    def _stream_for(self, agent: str, header: KVHeader, payload: bytes) -> _Stream | None:
        """The transfer this offer opens or continues, if it is that transfer's next part;
        None when it is dropped (logged), kept for later (its sender's regions have not come
        yet), or out of order (the transfer fails). The caller holds ``_table.lock``."""
        rid, side = header.request_id, self._table.side
        stream = self._streams.get(rid)
        if stream is None:
            entry = self._reservations.claim(rid, header.secret, "an offer")
            if entry is None:
                return None
            if self._nixl.peer(agent) is None:  # registered after its first offer left: wait
                self._unready.append((agent, payload))
                return None
            stream = _Stream(entry, agent, entry.deadline)
            entry.deadline = math.inf  # ours now (see the class)
            self._streams[rid] = stream
            self._table.advance(rid, KVPoll.TRANSFERRING)
        elif agent != stream.agent or not secret_matches(stream.entry, header.secret):
            log.warning("%s: dropped an offer for %r without its secret", side, rid)
            return None
        elif stream.complete or stream.problem is not None:
            log.warning("%s: dropped offer %d of %r: it is over", side, header.part, rid)
            return None
        if header.part != stream.next_part:
            stream.problem = f"offer {header.part} came where {stream.next_part} was due"
            return None
        return stream

    def _problem(self, h: KVHeader, stream: _Stream, peer_blocks: int) -> str | None:
        total, end = len(stream.entry.block_ids), stream.offset + len(h.dst_block_ids)
        expected = stream.entry.block_ids[stream.offset : end]
        problem = common.header_problem(h, self._layout, expected, self.require_checksum)
        if problem is None and not h.dst_block_ids:
            problem = "an offer of no blocks"
        if problem is None and h.last and end != total:
            problem = f"the last offer ends at block {end} of {total}"
        if problem is None and not h.last and end >= total:
            problem = f"offer {h.part} leaves no blocks for the last one"
        if problem is None and len(h.src_block_ids) != len(h.dst_block_ids):
            problem = f"{len(h.src_block_ids)} source blocks offered for {len(h.dst_block_ids)}"
        if problem is None and any(not 0 <= b < peer_blocks for b in h.src_block_ids):
            problem = "source blocks outside the sender's cache"
        return problem

    def _progress(self) -> None:
        """Finish the reads that ended; stop every read of a transfer that fails or ran past
        its deadline; settle the transfers with no read left."""
        now = time.monotonic()
        for rid, stream in list(self._streams.items()):
            with self._table.lock:
                if self._streams.get(rid) is not stream:
                    continue  # released by its owner meanwhile
                if stream.problem is None and now >= stream.deadline:
                    stream.problem = "timed out"
                for read in list(stream.reads):
                    self._finish(stream, read)
                if stream.reads or (stream.problem is None and not stream.complete):
                    continue
                del self._streams[rid]
                final = KVPoll.FAILED if stream.problem else KVPoll.DONE
                self._table.advance(rid, final, stream.problem)
            # NIXL told the sender of each read that ended well: of all of them, it is DONE
            told = stream.complete and stream.read_ok == stream.next_part
            if stream.problem is not None and not told:
                self._ack(stream.agent, rid, stream.problem)

    def _finish(self, stream: _Stream, read: _Read) -> None:
        """One read: over (checked) and released, or still running (cancelled if the
        transfer fails, as soon as NIXL can)."""
        state = self._nixl.state(read.handle)
        if state == "PROC" and stream.problem is None:
            return
        if not self._nixl.release(read.handle):
            return  # still running: NIXL cannot cancel it yet; try again next turn
        stream.reads.remove(read)
        if state == "ERR" and stream.problem is None:
            stream.problem = "read failed (the sender went away?)"
        elif state == "DONE":
            stream.read_ok += 1
            if stream.problem is None:
                stream.problem = self._checksum_problem(read)

    def _checksum_problem(self, read: _Read) -> str | None:
        if read.header.checksum is None:
            return None
        staged = [t.cpu() for t in common.gather(self._layers, read.header.dst_block_ids)]
        if common.checksum([common.as_bytes(t) for t in staged]) != read.header.checksum:
            return "checksum mismatch"
        return None

    def _ack(self, agent: str, rid: str, reason: str) -> None:
        """Tell the sender a transfer failed here, so its lease ends now (best effort)."""
        try:
            self._nixl.notify(agent, single_frame(KVAck(request_id=rid, ok=False, reason=reason)))
        except Exception as exc:
            log.debug("nixl receiver: cannot tell %s about %r: %s", agent, rid, exc)
