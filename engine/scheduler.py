"""Iteration-level scheduler: each step picks tokens for running and waiting sequences.

One token budget (``max_num_batched_tokens``, lowered at start-up to what runs within
``max_step_time_s`` here: engine/step_budget.py) covers decode tokens and prefill chunks
alike, so a long prompt is split over steps (chunked prefill) while decodes keep going. Running
sequences are served first, in order; when blocks run out the newest running sequence is
preempted (blocks freed, recomputed later from its tokens). Waiting sequences are admitted
FIFO while budget, ``max_num_seqs`` and blocks allow.

A sequence WAITING_FOR_REMOTE_KVS (a reservation: blocks another worker's KV is written into,
engine/kv_handoff.py) is kept in ``waiting_for_kvs`` and never scheduled; it holds its blocks
until the KV has landed and the sequences decoding from it take them over, or it is cancelled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sequence import RequestId, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.prefix_hit_tokens = 0  # prompt tokens served from the prefix cache, since start
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_kvs: dict[RequestId, Sequence] = {}  # reservations, by request id

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue ``seq``; ``front``: ahead of every waiting one (what was just running)."""
        seq.status = SequenceStatus.WAITING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def wait_for_kvs(self, seq: Sequence) -> None:
        """Keep ``seq`` (its blocks allocated) until another worker's KV has landed in them."""
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kvs[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        """Whether a step has work: waiting and running sequences (not reservations)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold or budget

        # 1. running sequences, oldest first; preempt from the back when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget, threshold)
            while not self.blocks.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1

        # 2. waiting sequences, FIFO, unless something was just preempted for lack of blocks
        while self.waiting and budget > 0 and not batch.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            seq = self.waiting[0]
            hits = self.blocks.find_cached_prefix(seq) if not seq.block_table else []
            remaining = seq.num_uncomputed_tokens - len(hits) * self.blocks.block_size
            n = min(remaining, budget, threshold)
            if not self.blocks.allocate(seq, n, hits):
                break
            if hits and seq.num_preemptions == 0:
                seq.num_cached_tokens = len(hits) * self.blocks.block_size
                self.prefix_hit_tokens += seq.num_cached_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def finish(self, seq: Sequence, free: bool = True) -> None:
        """Remove a finished (or aborted) sequence from its queue; free its blocks unless
        the caller keeps them (KV still to be sent elsewhere)."""
        if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
            del self.waiting_for_kvs[seq.request_id]
        elif seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free:
            self.blocks.free_seq(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.blocks.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
