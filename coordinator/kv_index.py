"""Which worker holds which prefix-cache block, from the workers' ``KVEvents``::

    holders   block hash -> {worker ids}        held   worker id -> {block hashes}

Per request, ``prefix_blocks`` walks the prompt's chained hashes (``protocol.prefix``, the
engine's own) and gives each worker its longest run of leading blocks held: what it would not
compute again. A worker's engine serves only a run from the first block, so the walk stops for
a worker at its first missing block.

A worker's messages form a stream (``epoch``, ``seq``): a new epoch is a restarted process and
forgets what the old one held; a gap in ``seq`` is only counted (a lost store costs a missed hit,
a lost eviction one worse choice) until the next snapshot replaces everything known of it. The
registry forgets a worker that re-registers or dies (``drop``).

Bounds: ``kv_events_problem`` refuses a malformed message before it gets here (the registry's
``admit`` calls it); here no worker is believed to hold more hashes than the blocks it
registered, so the index never grows past the cluster's KV blocks. A message that would break
that forgets the worker until its next snapshot.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pdserve.protocol.control import KVEvents
from pdserve.protocol.prefix import HASH_BITS, MAX_KV_EVENT_HASHES

logger = logging.getLogger(__name__)


def kv_events_problem(ev: KVEvents, num_blocks: int) -> str | None:
    """Why a ``KVEvents`` cannot be true of a worker that registered ``num_blocks``, or None.
    (What it adds up to over many messages is bounded by ``KVIndex.apply``.)"""
    if len(ev.stored) + len(ev.evicted) > MAX_KV_EVENT_HASHES:
        return f"{len(ev.stored) + len(ev.evicted)} hashes, at most {MAX_KV_EVENT_HASHES}"
    if not 1 <= len(ev.epoch) <= 64 or not 0 <= ev.seq < 1 << 63:
        return f"epoch {ev.epoch[:64]!r} or seq={ev.seq}"
    if any(not 0 <= h < 1 << HASH_BITS for h in (*ev.stored, *ev.evicted)):
        return f"a block hash outside [0, 2**{HASH_BITS})"
    max_parts = max(1, -(-num_blocks // MAX_KV_EVENT_HASHES))
    if ev.snapshot and (ev.evicted or not 0 <= ev.part < ev.parts <= max_parts):
        return f"snapshot part {ev.part} of {ev.parts} (at most {max_parts}) with evictions"
    if not ev.snapshot and (ev.part, ev.parts) != (0, 1):
        return f"part {ev.part} of {ev.parts} outside a snapshot"
    return None


@dataclass
class _Stream:
    epoch: str
    next_seq: int
    pending: set[int] | None = None  # a snapshot being received, part by part
    next_part: int = 0


class KVIndex:
    """Owns the two maps above and each worker's stream position (``_Stream``)."""

    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}
        self.held: dict[str, set[int]] = {}
        self._streams: dict[str, _Stream] = {}
        self.gaps = 0  # messages found missing (seq gaps)

    def apply(self, msg: KVEvents, capacity: int) -> str | None:
        """Take one message of a worker that registered ``capacity`` blocks; why it was
        refused (the worker is then forgotten until its next snapshot), or None."""
        wid = msg.worker_id
        stream = self._streams.get(wid)
        if stream is None or stream.epoch != msg.epoch:
            self.drop(wid)  # a new process: nothing the old one held is there
            stream = self._streams[wid] = _Stream(msg.epoch, msg.seq)
        if msg.seq != stream.next_seq:
            self.gaps += 1
            logger.info("kv events of %s: seq %d, expected %d", wid, msg.seq, stream.next_seq)
            stream.pending = None
        stream.next_seq = msg.seq + 1
        if msg.snapshot:
            return self._snapshot_part(wid, stream, msg, capacity)
        stream.pending = None
        for h in msg.evicted:
            self._remove(wid, h)
        held = self.held.setdefault(wid, set())
        for h in msg.stored:
            held.add(h)
            self.holders.setdefault(h, set()).add(wid)
        if len(held) > capacity:
            self._forget(wid)
            return f"{len(held)} cached blocks, more than the {capacity} blocks it registered"
        return None

    def _snapshot_part(self, wid: str, stream: _Stream, msg: KVEvents, capacity: int) -> str | None:
        if msg.part == 0:
            stream.pending = set()
        elif stream.pending is None or msg.part != stream.next_part:
            stream.pending = None  # a part went missing: wait for the next snapshot
            return None
        stream.pending.update(msg.stored)
        stream.next_part = msg.part + 1
        if len(stream.pending) > capacity:
            stream.pending = None
            self._forget(wid)
            return f"a snapshot of more than the {capacity} blocks it registered"
        if msg.part == msg.parts - 1:
            self._forget(wid)
            self.held[wid] = stream.pending
            for h in stream.pending:
                self.holders.setdefault(h, set()).add(wid)
            stream.pending = None
        return None

    def drop(self, worker_id: str) -> None:
        """Forget the worker altogether: it re-registered, restarted or died."""
        self._forget(worker_id)
        self._streams.pop(worker_id, None)

    def prefix_blocks(self, hashes: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """Each worker's run of the leading ``hashes`` it holds (0: none)."""
        run = dict.fromkeys(workers, 0)
        alive = set(run)
        for i, h in enumerate(hashes):
            alive &= self.holders.get(h, set())
            if not alive:
                break
            for wid in alive:
                run[wid] = i + 1
        return run

    def num_held(self, worker_id: str) -> int:
        return len(self.held.get(worker_id, ()))

    def _forget(self, wid: str) -> None:
        for h in self.held.pop(wid, set()):
            self._unhold(h, wid)

    def _remove(self, wid: str, h: int) -> None:
        held = self.held.get(wid)
        if held is not None and h in held:
            held.discard(h)
            self._unhold(h, wid)

    def _unhold(self, h: int, wid: str) -> None:
        workers = self.holders.get(h)
        if workers is not None:
            workers.discard(wid)
            if not workers:
                del self.holders[h]
