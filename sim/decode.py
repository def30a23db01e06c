"""A simulated decode worker, which may prefill prompts itself (colocated mode, conditional
disaggregation, and recomputing what it preempted): engine/scheduler.py's step, at a cost of
O(1) a step plus O(1) a joining, finishing or preempted stream.

    reserve ─▶ (KV lands) ready ─┐                                    ┌─▶ finished (blocks free,
    local prompt ─▶ waiting ─▶ prompts (chunked, shortest first) ─token─┤     prefix cached)
                      ▲                                            running ──┘
                      └────────── preempted (recomputed: prompt + tokens so far) ◀──┘

A running stream emits a token each step. It joined at step ``join`` holding the KV of
``context0`` tokens; at step s it writes position p = context0 + (s − join) and holds
blocks_for(p + 1) after it, so it needs a new block exactly when p is a multiple of the block
size: the streams needing one at step s are those with (join − context0) ≡ s (mod block size),
counted per residue (``_due``). The batch's summed context grows by the batch each step.
When a step cannot get its blocks the newest stream of the lowest tier is preempted.

Stall-free steps (``--tpot-target-ms``): a step with decodes adds the prompt tokens that keep it
within the target (``StepTimes.room``), shortest prompt first; a prompt that has gone
``age_bound_s`` without a token computed is overdue until done, and the overdue ones take a
block's tokens a step past the room between them. With no decodes, or no target, prompts take
the step budget.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from pdserve.protocol.blocks import blocks_for
from pdserve.sim.cache import PrefixCache, look_up, offer
from pdserve.sim.config import SimConfig
from pdserve.sim.events import EventLoop, Waker
from pdserve.sim.seq import PromptJob, Seq
from pdserve.sim.steps import StepTimes


class DecodeWorker:
    def __init__(
        self,
        name: str,
        loop: EventLoop,
        times: StepTimes,
        config: SimConfig,
        freed: Callable[[DecodeWorker], None],
        finished: Callable[[Seq], None],
    ) -> None:
        self.name = name
        self.loop = loop
        self.times = times
        self.config = config
        self.freed = freed  # blocks were freed (the coordinator's queue may go on)
        self.finished = finished
        self.bs = times.block_size
        self.total_blocks = times.profile.kv_blocks
        self.used_blocks = 0  # running streams, prompts, reservations
        self.budget = times.budget_tokens(config.max_num_batched_tokens, config.max_step_time_s)
        self.target = times.tpot_target(config.tpot_target_s)
        self.cache = PrefixCache(self.bs, config.prefix_cache)
        self.ready: deque[Seq] = deque()
        self._joining: list[Seq] = []  # prompts done last step: they decode from this one
        self.reserved = 0  # streams whose KV is on its way
        self.prompts: list[PromptJob] = []
        self._waiting: list[tuple[bool, int, int, PromptJob]] = []
        self.running: dict[Seq, None] = {}
        self._ends: list[tuple[int, int, int, Seq]] = []  # (last step, order, epoch, seq)
        self._due = [0] * self.bs
        self._context_sum = 0
        self._step_no = 0
        self._order = itertools.count()
        self.busy = False
        self._wake = Waker(loop, self._step, lambda: self.busy).wake
        self.stats = {
            "steps": 0,
            "seconds": 0.0,
            "mixed": 0,
            "decode_seqs": 0,
            "prompt_tokens": 0,
            "preempted": 0,
        }

    # ---- what the coordinator sees ------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    @property
    def streams(self) -> int:
        return len(self.running) + len(self.ready) + self.reserved

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens it has still to compute (its own prompts and recomputes)."""
        waiting = sum(job.remaining for _, _, _, job in self._waiting)
        return waiting + sum(job.remaining for job in self.prompts)

    def hit(self, prefixes: tuple[tuple[str, int], ...]) -> int:
        self.cache.trim(self.free_blocks * self.bs)
        return self.cache.peek(prefixes)

    # ---- work arriving ------------------------------------------------------------------------
    def reserve(self, blocks: int) -> None:
        """Blocks a prompt's KV will be written into (the coordinator checked they are free)."""
        self.used_blocks += blocks
        self.reserved += 1

    def kv_landed(self, seq: Seq) -> None:
        self.reserved -= 1
        self.ready.append(seq)
        self._wake()

    def prefill_here(self, job: PromptJob) -> None:
        """A prompt to prefill here; its blocks are held from now on."""
        self.used_blocks += job.blocks
        self._queue(job)

    def _queue(self, job: PromptJob) -> None:
        key = (not job.recompute, job.seq.tier, next(self._order), job)
        heapq.heappush(self._waiting, key)
        self._wake()

    # ---- one step -----------------------------------------------------------------------------
    def _held(self, seq: Seq, step: int) -> int:
        """Blocks ``seq`` holds before step ``step`` writes."""
        return blocks_for(max(seq.context0 + 1, seq.context0 + step - seq.join), self.bs)

    def _due_now(self, seq: Seq, step: int) -> bool:
        return step > seq.join and (seq.join - seq.context0 - step) % self.bs == 0

    def _step(self) -> None:
        s = self._step_no
        need = self._due[s % self.bs]
        while need and self.used_blocks + need > self.total_blocks and self.running:
            victim = self._victim()
            if self._due_now(victim, s):
                need -= 1
            self._preempt(victim, s)
        self.used_blocks += need
        for seq in self._joining:
            self._join(seq, s)
        self._joining.clear()
        slots = self.config.max_num_seqs
        while self.ready and len(self.running) + len(self.prompts) < slots:
            self._join(self.ready.popleft(), s)
        self._activate(slots)
        if not self.running and not self.prompts and not self._joining:
            self.busy = False
            return
        batch = len(self.running)
        context = self._context_sum / batch if batch else 0.0
        chunks = self._chunks(batch, context)
        tokens = sum(take for _, take in chunks)
        seconds = self.times.mixed(tokens, batch, context)
        self.busy = True
        stats = self.stats
        stats["steps"] += 1
        stats["seconds"] += seconds
        stats["decode_seqs"] += batch
        stats["prompt_tokens"] += tokens
        if tokens and batch:
            stats["mixed"] += 1
        self.loop.after(seconds, self._end_step, chunks, batch)

    def _activate(self, slots: int) -> None:
        """Waiting prompts start while there are slots (a preempted stream's first, and only with
        the blocks its recompute needs: it gave its own up)."""
        while self._waiting and len(self.running) + len(self.prompts) < slots:
            job = self._waiting[0][3]
            if job.recompute:
                if self.used_blocks + job.blocks > self.total_blocks:
                    return
                self.used_blocks += job.blocks
            heapq.heappop(self._waiting)
            look_up(self.cache, job)
            job.since = self.loop.now
            self.prompts.append(job)

    def _chunks(self, batch: int, context: float) -> list[tuple[PromptJob, int]]:
        if not self.prompts:
            return []
        most = max(0, self.budget - batch)
        if batch and self.target > 0:
            room = self.times.room(batch, context, self.target, most)
        else:
            room = most
        now = self.loop.now
        age = self.config.age_bound_s
        takes: dict[int, int] = {}
        for job in sorted(self.prompts, key=lambda j: (j.seq.tier, j.remaining)):
            if room <= 0:
                break
            takes[id(job)] = min(job.remaining, room)
            room -= takes[id(job)]
        extra = self.bs if batch and self.target > 0 else 0
        for job in self.prompts:
            if not job.overdue and now - job.since >= age:
                job.overdue = True
            if job.overdue and extra > 0:
                more = min(job.remaining - takes.get(id(job), 0), extra)
                takes[id(job)] = takes.get(id(job), 0) + more
                extra -= more
        return [(job, takes[id(job)]) for job in self.prompts if takes.get(id(job), 0) > 0]

    def _end_step(self, chunks: list[tuple[PromptJob, int]], batch: int) -> None:
        s = self._step_no
        t = self.loop.now + self.config.hop_s  # at the gateway
        self._step_no = s + 1
        self._context_sum += batch
        if self.config.record_gaps:
            for seq in self.running:
                seq.emit(t, True)
        freed = False
        ends = self._ends
        while ends and ends[0][0] <= s:
            _, _, epoch, seq = heapq.heappop(ends)
            if epoch == seq.epoch:  # else it left the batch since (a later entry is its own)
                self._finish(seq, s, t)
                freed = True
        for job, take in chunks:
            job.done += take
            job.since = self.loop.now
            offer(self.cache, job, self.free_blocks * self.bs)
            if job.remaining <= 0:
                self.prompts.remove(job)
                seq = job.seq
                seq.emit(t, self.config.record_gaps)
                if seq.left <= 0:
                    self.used_blocks -= job.blocks
                    self._cache(seq)
                    self.finished(seq)
                    freed = True
                else:
                    seq.context0 = job.tokens if job.recompute else seq.out.req.prompt_tokens
                    self._joining.append(seq)
        if freed:
            self._freed()
        self._step()

    # ---- streams ------------------------------------------------------------------------------
    def _join(self, seq: Seq, step: int) -> None:
        """``seq`` decodes from step ``step`` on; it holds blocks_for(context0 + 1)."""
        if seq.left <= 0:  # one token wanted, and token 0 was it
            self.used_blocks -= blocks_for(seq.context0 + 1, self.bs)
            self._cache(seq)
            self.finished(seq)
            self._freed()
            return
        seq.join = step
        seq.epoch += 1
        self.running[seq] = None
        self._context_sum += seq.context0
        self._due[(step - seq.context0) % self.bs] += 1
        heapq.heappush(self._ends, (step + seq.left - 1, seq.order, seq.epoch, seq))
        seq.out.tokens = seq.emitted

    def _leave(self, seq: Seq, step: int) -> int:
        """Take ``seq`` out of the batch before step ``step`` writes; its blocks held then."""
        del self.running[seq]
        seq.epoch += 1
        self._context_sum -= seq.context0 + step - seq.join
        self._due[(seq.join - seq.context0) % self.bs] -= 1
        if not self.config.record_gaps:  # its tokens so far, one a step since it joined
            seq.emitted += step - seq.join
        return self._held(seq, step)

    def _finish(self, seq: Seq, step: int, t: float) -> None:
        """``seq``'s last token came out of step ``step`` at ``t``."""
        self.used_blocks -= self._leave(seq, step + 1)
        if not self.config.record_gaps:
            seq.out.t_last = t
            seq.out.tokens = seq.emitted
        self._cache(seq)
        self.finished(seq)

    def _freed(self) -> None:
        """Tell the coordinator, after this event (never from inside a step being built)."""
        self.loop.after(0.0, self.freed, self)

    def _victim(self) -> Seq:
        """The newest stream of the lowest tier (the highest tier number)."""
        return max(self.running, key=lambda q: (q.tier, q.join, q.order))

    def _preempt(self, seq: Seq, step: int) -> None:
        self.used_blocks -= self._leave(seq, step)
        seq.out.preempted += 1
        self.stats["preempted"] += 1
        if not self.config.record_gaps:
            seq.out.tokens = seq.emitted
        tokens = seq.out.req.prompt_tokens + seq.emitted
        job = PromptJob(seq, tokens, blocks_for(tokens + 1, self.bs), self.loop.now, recompute=True)
        self._queue(job)

    def _cache(self, seq: Seq) -> None:
        req = seq.out.req
        capacity = self.free_blocks * self.bs
        for key, tokens in req.prefixes:
            self.cache.insert(key, tokens, capacity)
        if req.key is not None:
            self.cache.insert(req.key, req.prompt_tokens + req.output_tokens, capacity)
