"""The engine's scheduler and the sequences it schedules: each step it picks tokens for the
running and waiting sequences.

Status of a sequence (each one is in exactly one of the scheduler's queues)::

    reserve ─▶ WAITING_FOR_REMOTE_KVS ─KV landed: add_prefilled(_n)─▶ its blocks decode on
    add_request ─▶ WAITING ─schedule─▶ RUNNING ─stop/length─▶ FINISHED (hold_kv: KV kept,
                      ▲                   │                            until released)
                      └──── preempted ────┘   (blocks freed, recomputed later)
    abort from any state ─▶ FINISHED (finish_reason ABORT)

One token budget (``max_num_batched_tokens``, lowered at start-up to what runs within
``max_step_time_s`` here: engine/step_budget.py) covers decode tokens and prefill chunks
alike, so a long prompt is split over steps (chunked prefill) while decodes keep going. Running
sequences are served first, in order; when blocks run out the newest running sequence is
preempted (blocks freed, recomputed later from its tokens). Waiting sequences are admitted
while budget, ``max_num_seqs`` and blocks allow, in the fair queue's order
(pdserve/fair_queue.py: by each one's ``share``: tier, then the tenants' weighted shares of
prompt tokens, then priority and arrival), a preempted one first; a waiting sequence that
does not fit blocks those after it (no smaller one jumps it). Should nothing be able to run
(the head needs blocks that waiting sequences hold: KV landed here, not yet running), those
holders give their blocks up too, the last in ``keep_order`` first, so the cache never locks.

A sequence grows one block at a time as it decodes (admission is by need: README "KV by
need"); it ends with LENGTH when it has as many tokens as the whole cache holds
(``max_seq_tokens``), since no preemption could make room for more.

Stall-free steps (``cap``: engine/step_model.py sizes it): a step carrying decodes adds only the
prompt tokens that keep its predicted time within the TPOT target; the rest wait for the next
step, and the step's prompt work goes shortest first (running prompts and the waiting queue's
head, whose order stands among the waiting), so a short prompt is not held behind a long one's
chunks. A prompt that has gone ``age_bound_s`` without a token computed is overdue until its
prompt is done: overdue prompts take a block's tokens a step past the cap between them, so none
starves. With no decodes running, prompts take the whole budget; decodes later in the running
list keep their share of it.

A reservation (engine/kv_handoff.py) is a sequence WAITING_FOR_REMOTE_KVS, kept in
``waiting_for_kvs`` and never scheduled: blocks that another worker's KV is written into, held
until the KV has landed and the sequences decoding from it take them over (it is then
FINISHED), or it is cancelled.

A prompt computed once for ``n`` choices (engine/fork.py) is a sequence of its own whose
``choices`` wait outside the queues until its last logits give each its token 0; then they
enter WAITING with forked blocks (or finish there) and the prompt sequence is FINISHED.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import llguidance
import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.prefill_cap import PrefillCap, PrefillRoom
from pdserve.fair_queue import FairQueue
from pdserve.protocol.messages import FinishReason, TokenLogprob
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tenancy import DEFAULT, Share

# An engine request id: any hashable value (a string in tests and ``generate``; a worker's typed
# key, pdserve.protocol.keys.ChoiceKey, for one choice of a request). Never parsed.
RequestId = Hashable


class SequenceStatus(enum.Enum):
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request inside the engine: its tokens, blocks, sampling state and status."""

    request_id: RequestId
    token_ids: list[int]  # prompt, then generated tokens appended in place
    params: SamplingParams
    share: Share = DEFAULT  # who it is for: the order it waits in (pdserve/fair_queue.py)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # asked for (``params.prompt_logprobs``): of prompt tokens 1.. in order, as computed (a
    # prefix-cache hit is not taken: every prompt position is computed here)
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_scored: bool = False  # they went out in an output (``LLMEngine._output``)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id, when one ended the sequence
    # KV state
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    recompute_until: int = 0  # tokens computed before its last preemption (recomputed ones)
    arrival: int | None = None  # the scheduler's count when it first queued it (``keep_order``)
    # when the scheduler queued it or last computed prompt tokens of it (its clock), and
    # whether it went the age bound without any (engine/prefill_cap.py)
    progress_s: float | None = None
    overdue: bool = False
    generator: torch.Generator | None = None
    hold_kv: bool = False  # keep blocks after finishing (prefill worker: KV still to send)
    num_prompt_tokens: int = field(init=False, default=0)
    # Tokens handed out by earlier step() outputs (so each output carries only new ones).
    num_returned_tokens: int = 0
    # Sampler state for penalties, kept across steps: a PenaltyState | None. Any, as
    # engine/sampler.py (which defines it) imports this module, and get_type_hints(Sequence)
    # must resolve every field
    penalty: Any = None
    # llguidance matcher of a constrained request (engine/grammar.py), advanced per token
    matcher: llguidance.LLMatcher | None = None
    # speculation (engine/spec/): token slots its next decode step may verify past its one
    # token (the scheduler allocates them or drops them), the drafts that step verifies, the
    # trailing computed tokens a draft model has not computed yet, and the proposer's state
    lookahead: int = 0
    spec_tokens: list[int] = field(default_factory=list)
    draft_lag: int = 0
    spec: Any = None
    # n choices of one prompt (engine/fork.py): on the prompt's sequence, its choices until
    # their token 0 is drawn; on each such choice, that prompt's sequence
    choices: list[Sequence] | None = field(default=None, repr=False, compare=False)
    parent: Sequence | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def scoring_prompt(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (prompt tokens 1.. have one)."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens - 1

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_decoding(self) -> bool:
        """Its next computation is one generated token's (a decode step): not prompt work."""
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    decode_seqs: int = 0  # sequences in it taking one decode token
    spec_slots: int = 0  # token slots past their one token the decodes took for drafts
    # prompt tokens overdue prompts took past the cap (``PrefillCap``): 0 when none did
    overdue_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        """Tokens of prompt work (chunks, recomputation): all but the decode steps."""
        return self.num_tokens - self.decode_seqs - self.spec_slots

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Owns the queues a sequence is in (``waiting``, ``running``, ``waiting_for_kvs``) and
    picks each step's batch from them."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        cap: PrefillCap | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.cap = cap
        self.clock = clock
        self.prefix_hit_tokens = 0  # prompt tokens served from the prefix cache, since start
        self.preemptions = 0  # sequences preempted for blocks (and holders freed), since start
        self._arrivals = itertools.count()
        # by share; the cost a tenant is charged is the tokens still to compute when queued
        self.waiting: FairQueue[Sequence] = FairQueue()
        self.running: list[Sequence] = []
        self.waiting_for_kvs: dict[RequestId, Sequence] = {}  # reservations, by request id

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue ``seq``; ``front``: ahead of every waiting one (what was just running)."""
        seq.status = SequenceStatus.WAITING
        if seq.arrival is None:
            seq.arrival = next(self._arrivals)
        if seq.progress_s is None:
            seq.progress_s = self.clock()
        if front:
            self.waiting.push_front(seq)
        else:
            self.waiting.push(seq, seq.share, seq.num_uncomputed_tokens)

    def wait_for_kvs(self, seq: Sequence) -> None:
        """Keep ``seq`` (its blocks allocated) until another worker's KV has landed in them."""
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kvs[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        """Whether a step has work: waiting and running sequences (not reservations)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule()
        # nothing can run: the head needs blocks waiting sequences hold; they give them up
        while not batch and not self.running and self._free_a_holder():
            batch = self._schedule()
        return batch

    def _schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold or budget
        room = PrefillRoom(self.cap, self.running, self.clock())
        capped = room.left is not None  # a target, and decodes running
        deferred: list[Sequence] = []  # capped: running prompts, to go with the waiting ones

        # 1. running sequences, oldest first; preempt from the back when blocks run out. The
        # budget of the decodes further on is kept for them.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            decoding = seq.is_decoding
            if capped and not decoding:
                deferred.append(seq)
                i += 1
                continue
            n = min(seq.num_uncomputed_tokens, budget - room.decodes_after(decoding), threshold)
            if decoding and seq.lookahead:
                after = len(self.running) - i - 1  # each may need a block of its own
                if self._take_lookahead(seq, budget - room.decodes_after(True), after):
                    self._add(batch, seq, 1 + seq.lookahead, True, room)
                    batch.spec_slots += seq.lookahead
                    budget -= 1 + seq.lookahead
                    i += 1
                    continue
            while not self.blocks.allocate(seq, n):
                victim = self.running.pop()
                room.dropped(victim)
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:
                self._add(batch, seq, n, decoding, room)
                budget -= n
                i += 1

        # 2. prompt work: uncapped, the waiting sequences in the fair queue's order; capped,
        # shortest first with the running prompts. Nothing waiting is admitted once something
        # was preempted for lack of blocks.
        waiting_open = not batch.preempted
        deferred.sort(key=lambda s: s.num_uncomputed_tokens)
        while budget > 0:
            head = self._head() if waiting_open else None
            if deferred and (head is None or deferred[0].num_uncomputed_tokens <= head[1]):
                seq = deferred.pop(0)  # a running prompt, capped (it keeps its blocks)
                n = room.take(seq, min(seq.num_uncomputed_tokens, budget, threshold))
                if n > 0 and self.blocks.allocate(seq, n):
                    self._add(batch, seq, n, False, room)
                    budget -= n
                continue
            if head is None:
                break
            seq, remaining, hits = head
            n = min(remaining, budget, threshold)
            n = n if seq.is_decoding else room.take(seq, n)
            if n <= 0 or not self.blocks.allocate(seq, n, hits):
                waiting_open = False  # it blocks those after it
                continue
            self._admit(seq, hits)
            self._add(batch, seq, n, seq.is_decoding, room)
            budget -= n
        batch.overdue_tokens = room.overdue_tokens
        return batch

    def _take_lookahead(self, seq: Sequence, budget: int, keep_blocks: int) -> bool:
        """Blocks and budget for a decode and its ``lookahead`` draft slots, when both are
        there with ``keep_blocks`` left free for the decodes after it; else the drafts are
        dropped (speculation never preempts anything)."""
        blocks = self.blocks
        total = seq.num_computed_tokens + 1 + seq.lookahead
        fresh = blocks.blocks_needed(total) - len(seq.block_table)
        if (
            1 + seq.lookahead <= budget
            and fresh + keep_blocks <= blocks.num_free_blocks
            and blocks.allocate(seq, 1 + seq.lookahead)
        ):
            return True
        seq.lookahead = 0
        seq.spec_tokens = []
        return False

    def _head(self) -> tuple[Sequence, int, list[int]] | None:
        """The next waiting sequence, its tokens left to compute and its prefix-cache hits;
        None when nothing waits or ``max_num_seqs`` run."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        seq = self.waiting.peek()
        scored = seq.scoring_prompt  # its prompt's logits are all needed
        hits = self.blocks.find_cached_prefix(seq) if not seq.block_table and not scored else []
        return seq, seq.num_uncomputed_tokens - len(hits) * self.blocks.block_size, hits

    def _admit(self, seq: Sequence, hits: list[int]) -> None:
        """The head of the queue, its blocks allocated, starts running."""
        if hits and seq.num_preemptions == 0:
            seq.num_cached_tokens = len(hits) * self.blocks.block_size
            self.prefix_hit_tokens += seq.num_cached_tokens
        self.waiting.pop()
        seq.status = SequenceStatus.RUNNING
        keys = [keep_order(s) for s in self.running]
        self.running.insert(bisect.bisect_right(keys, keep_order(seq)), seq)

    @staticmethod
    def _add(
        batch: ScheduledBatch, seq: Sequence, n: int, decoding: bool, room: PrefillRoom
    ) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.decode_seqs += decoding
        room.used(seq, n, decoding)

    def finish(self, seq: Sequence, free: bool = True) -> None:
        """Remove a finished (or aborted) sequence from its queue; free its blocks unless
        the caller keeps them (KV still to be sent elsewhere)."""
        if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
            del self.waiting_for_kvs[seq.request_id]
        elif seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if free:
            self.blocks.free_seq(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._drop_kv(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.push_front(seq)
        batch.preempted.append(seq)

    def _drop_kv(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks: every token stays, its KV is computed again later (what a
        prefix cache still holds of it is found again then)."""
        self.blocks.free_seq(seq)
        seq.lookahead, seq.spec_tokens, seq.draft_lag = 0, [], 0
        seq.recompute_until = max(seq.recompute_until, seq.num_computed_tokens)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.preemptions += 1

    def _free_a_holder(self) -> bool:
        """A waiting sequence holding blocks (the last in ``keep_order``) gives them up, to be
        recomputed; False when no waiting sequence holds any."""
        holders = [s for s in self.waiting if s.block_table]
        if not holders:
            return False
        self._drop_kv(max(holders, key=keep_order))
        return True


def keep_order(seq: Sequence) -> tuple[int, int, int]:
    """The order running sequences keep their blocks in, first first: highest tier, lowest
    priority value, oldest. A step short of blocks preempts from the end."""
    arrival = seq.arrival if seq.arrival is not None else -1
    return -seq.share.tier.rank, seq.share.priority, arrival
