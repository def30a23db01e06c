"""What a worker tells the coordinator of its prefix cache, so requests go where their prefix is
(``coordinator.kv_index``): ``KVEvents`` messages built on the loop thread beside each heartbeat.

    block manager ── stored(h) / evicted(h) ──▶ KVEventLog (hash -> held now?, bounded)
    each period   ── KVEventPublisher.messages() ──▶ deltas, or a snapshot of every cached hash

A delta holds each hash's latest change only (stored then evicted in one period: evicted), so
its stored and evicted lists are disjoint and apply in any order. A snapshot goes out at the
first period (the coordinator may know an older process under this id), every
``snapshot_every`` periods (a coordinator that restarted or lost a message heals), and instead
of a delta that would not fit the log's bound. Losing a message only costs routing quality
(a hit missed, or a worker preferred for a block it no longer holds), never correctness.
"""

from __future__ import annotations

import secrets

from pdserve.engine.block_manager import BlockManager
from pdserve.protocol.control import KVEvents
from pdserve.protocol.prefix import MAX_KV_EVENT_HASHES

SNAPSHOT_EVERY = 30  # periods (heartbeats: 30 s) between snapshots


class KVEventLog:
    """Changes to the prefix cache since the last ``drain``; past ``limit`` distinct hashes it
    keeps nothing and reports ``overflowed`` (the publisher then sends a snapshot)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.changes: dict[int, bool] = {}  # hash -> held (stored) or not (evicted), latest
        self.overflowed = False

    def stored(self, block_hash: int) -> None:
        self._note(block_hash, True)

    def evicted(self, block_hash: int) -> None:
        self._note(block_hash, False)

    def _note(self, block_hash: int, held: bool) -> None:
        if self.overflowed:
            return
        self.changes[block_hash] = held
        if len(self.changes) > self.limit:
            self.overflowed = True
            self.changes.clear()

    def drain(self) -> tuple[dict[int, bool], bool]:
        out = self.changes, self.overflowed
        self.changes, self.overflowed = {}, False
        return out


class KVEventPublisher:
    """The ``KVEvents`` of one worker's engine; call ``messages`` once a period."""

    def __init__(
        self,
        block_manager: BlockManager,
        worker_id: str,
        snapshot_every: int = SNAPSHOT_EVERY,
        max_hashes: int = MAX_KV_EVENT_HASHES,
    ) -> None:
        if snapshot_every < 1 or max_hashes < 1:
            raise ValueError("snapshot_every and max_hashes must be at least 1")
        self.block_manager = block_manager
        self.worker_id = worker_id
        self.epoch = secrets.token_hex(8)
        self.seq = 0
        self.snapshot_every = snapshot_every
        self.max_hashes = max_hashes
        self._periods = snapshot_every  # the first period sends a snapshot
        # more changes than blocks in one period: a snapshot is no larger than the delta
        self.log = KVEventLog(limit=max(block_manager.num_blocks, max_hashes))
        block_manager.events = self.log

    def messages(self) -> list[KVEvents]:
        """This period's messages (none when nothing changed), in the order to send them."""
        changes, overflowed = self.log.drain()
        self._periods += 1
        if overflowed or self._periods >= self.snapshot_every:
            self._periods = 0
            return self._snapshot()
        items = list(changes.items())
        out = []
        for i in range(0, len(items), self.max_hashes):
            chunk = items[i : i + self.max_hashes]
            stored = [h for h, held in chunk if held]
            out.append(self._message(stored, [h for h, held in chunk if not held]))
        return out

    def _snapshot(self) -> list[KVEvents]:
        held = list(self.block_manager.cached) if self.block_manager.enable_prefix_caching else []
        step = self.max_hashes
        parts = max(1, -(-len(held) // step))
        return [
            self._message(held[i * step : (i + 1) * step], [], snapshot=True, part=i, parts=parts)
            for i in range(parts)
        ]

    def _message(
        self,
        stored: list[int],
        evicted: list[int],
        snapshot: bool = False,
        part: int = 0,
        parts: int = 1,
    ) -> KVEvents:
        msg = KVEvents(
            worker_id=self.worker_id,
            epoch=self.epoch,
            seq=self.seq,
            stored=stored,
            evicted=evicted,
            snapshot=snapshot,
            part=part,
            parts=parts,
        )
        self.seq += 1
        return msg
