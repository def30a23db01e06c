"""A simulated prefill worker: prompts in the fair queue's order (tier, then arrival), each step
up to the step budget's tokens, long prompts in chunks (prefill/worker.py's engine with no
decodes: prompts take the whole budget)::

    submit ─▶ waiting ─blocks free─▶ active ─last chunk─▶ done(job): token 0, then the KV
    (blocks held from admission until ``release``, when its transfer has landed)
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from pdserve.protocol.blocks import blocks_for
from pdserve.sim.cache import PrefixCache, look_up, offer
from pdserve.sim.config import SimConfig
from pdserve.sim.events import EventLoop, Waker
from pdserve.sim.seq import PromptJob
from pdserve.sim.steps import StepTimes


class PrefillWorker:
    def __init__(
        self,
        name: str,
        loop: EventLoop,
        times: StepTimes,
        config: SimConfig,
        done: Callable[[PrefillWorker, PromptJob], None],
    ) -> None:
        self.name = name
        self.loop = loop
        self.times = times
        self.done = done
        self.block_size = times.block_size
        self.total_blocks = times.profile.kv_blocks
        self.used_blocks = 0
        self.budget = times.budget_tokens(config.max_num_batched_tokens, config.max_step_time_s)
        self.cache = PrefixCache(self.block_size, config.prefix_cache)
        self._waiting: list[tuple[int, int, PromptJob]] = []  # (tier, order, job)
        self._order = itertools.count()
        self.active: list[PromptJob] = []
        self.queued_tokens = 0  # prompt tokens it has still to compute
        self.busy = False
        self._wake = Waker(loop, self._step, lambda: self.busy).wake
        self.busy_s = 0.0
        self.link_free_at = 0.0  # its KV link's next free moment

    def hit(self, prefixes: tuple[tuple[str, int], ...]) -> int:
        return self.cache.peek(prefixes)

    def submit(self, job: PromptJob) -> None:
        heapq.heappush(self._waiting, (job.seq.tier, next(self._order), job))
        self.queued_tokens += job.tokens
        self._wake()

    def release(self, blocks: int) -> None:
        """A transfer landed: its blocks are free (its prompt stays in the prefix cache)."""
        self.used_blocks -= blocks
        if self._waiting:
            self._wake()

    def _admit(self) -> None:
        """Waiting prompts become active while blocks allow and the active ones leave room in
        the next step."""
        ahead = sum(job.remaining for job in self.active)
        while self._waiting and ahead < self.budget:
            job = self._waiting[0][2]
            if self.used_blocks + job.blocks > self.total_blocks and self.active:
                return  # the head waits for blocks; nothing jumps it
            heapq.heappop(self._waiting)
            self.queued_tokens += look_up(self.cache, job)
            self.used_blocks += job.blocks
            self.active.append(job)
            ahead += job.remaining

    def _step(self) -> None:
        self._admit()
        if not self.active:
            self.busy = False
            return
        room = self.budget
        chunks: list[tuple[PromptJob, int]] = []
        for job in self.active:
            if room <= 0:
                break
            take = min(job.remaining, room)
            chunks.append((job, take))
            room -= take
        tokens = self.budget - room
        seconds = self.times.prefill(tokens)
        self.busy = True
        self.busy_s += seconds
        self.loop.after(seconds, self._end_step, chunks)

    def _end_step(self, chunks: list[tuple[PromptJob, int]]) -> None:
        finished = []
        capacity = (self.total_blocks - self.used_blocks) * self.block_size
        for job, take in chunks:
            job.done += take
            self.queued_tokens -= take
            offer(self.cache, job, capacity)
            if job.remaining <= 0:
                finished.append(job)
        for job in finished:
            self.active.remove(job)
            req = job.seq.out.req
            if req.key is not None:
                self.cache.insert(req.key, req.prompt_tokens, capacity)
            self.done(self, job)
        self._step()


def prompt_blocks(tokens: int, block_size: int) -> int:
    """Blocks a prompt of ``tokens`` holds, with token 0's slot."""
    return blocks_for(tokens + 1, block_size)
