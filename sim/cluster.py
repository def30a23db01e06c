"""The simulated cluster: the gateway's and the coordinator's part (admission, the queue for
decode blocks, placement by the coordinator's own policy objects, conditional disaggregation)
and the KV links between the pools; ``simulate`` runs requests through it.

    arrival ─hop─▶ coordinator: too big? ─▶ place ─┬─ local (colocated, or the conditional rule):
                      │ no decode room: queue      │    the decode worker prefills it
                      ▼ (tier, arrival order)      └─ split: reserve on the decode worker,
                  retried when blocks free              prefill worker ─token 0─▶ gateway
                                                         └─KV over its link─▶ decode worker

The coordinator sees every worker's figures as they are (the real one sees them as of the last
heartbeat, with its own estimates of what it placed since: close at the rates where it
matters)."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.coordinator.policies import (
    AdmissionPolicy,
    Candidate,
    ConditionalDisaggPolicy,
    PlacementPolicy,
    RoutingMode,
)
from pdserve.coordinator.profile import Profile
from pdserve.sim.config import Layout, SimConfig
from pdserve.sim.decode import DecodeWorker
from pdserve.sim.events import EventLoop
from pdserve.sim.prefill import PrefillWorker, prompt_blocks
from pdserve.sim.request import SimRequest
from pdserve.sim.results import Outcome
from pdserve.sim.seq import PromptJob, Seq
from pdserve.sim.steps import StepTimes

MAX_EVENTS = 1 << 28  # a bound on one run, whatever it is asked
Follow = Callable[[Outcome, float], Iterable[SimRequest]]


@dataclass
class Run:
    """What ``simulate`` returns: every request's ``Outcome`` in arrival order, each worker's
    step counters, the events run and the wall seconds it took."""

    outcomes: list[Outcome]
    workers: dict[str, dict[str, float]] = field(default_factory=dict)
    events: int = 0
    wall_s: float = 0.0


class Cluster:
    def __init__(
        self,
        layout: Layout,
        config: SimConfig,
        decode_profile: Profile,
        prefill_profile: Profile | None = None,
    ) -> None:
        self.layout = layout
        self.config = config
        self.loop = EventLoop()
        dtimes = StepTimes(decode_profile)
        self.block_size = dtimes.block_size
        self.decodes = [
            DecodeWorker(f"decode-{i}", self.loop, dtimes, config, self._freed, self._finished)
            for i in range(layout.decode)
        ]
        self._largest_decode_blocks = dtimes.profile.kv_blocks  # every decode worker's
        self.prefills: list[PrefillWorker] = []
        if layout.mode == "disagg":
            if prefill_profile is None:
                raise ValueError("a disaggregated layout needs a prefill profile")
            if prefill_profile.block_size != self.block_size:
                raise ValueError(
                    f"the prefill profile's block size ({prefill_profile.block_size}) is not the "
                    f"decode profile's ({self.block_size}): the pools could not pair"
                )
            ptimes = StepTimes(prefill_profile)
            self.prefills = [
                PrefillWorker(f"prefill-{i}", self.loop, ptimes, config, self._prefilled)
                for i in range(layout.prefill)
            ]
        self.policy = PlacementPolicy(config.routing)
        self.local = ConditionalDisaggPolicy(
            config.max_local_prefill_tokens, config.max_prefill_queue_tokens
        )
        self.admission = AdmissionPolicy(config.max_queued)
        self._queue: list[tuple[int, int, Seq]] = []  # choices waiting for decode blocks
        self._last: dict[str, str | None] = {"prefill": None, "decode": None}
        self._targets: dict[int, tuple[DecodeWorker, int]] = {}  # id(job) -> (decode, tokens)
        self._order = itertools.count()
        self.outcomes: list[Outcome] = []
        self._follow: Follow | None = None

    # ---- running ------------------------------------------------------------------------------
    def run(
        self,
        requests: Iterable[SimRequest],
        until: float = float("inf"),
        follow: Follow | None = None,
    ) -> Run:
        """Run ``requests``; ``follow`` (a closed loop: a client that sends its next request
        when one ends) is told of every request that ends, with the time it ended, and returns
        the requests it sends then (their ``arrival_s`` no earlier than that time)."""
        started = time.perf_counter()
        self._follow = follow
        for req in requests:
            self.submit(req)
        self.loop.run(until, MAX_EVENTS)
        for out in self.outcomes:
            if not out.failed and not out.done:
                out.failed = "unfinished"  # still running when the run stopped
        workers = {w.name: {"busy_s": w.busy_s} for w in self.prefills}
        workers.update({w.name: dict(w.stats) for w in self.decodes})
        return Run(self.outcomes, workers, self.loop.events, time.perf_counter() - started)

    def submit(self, req: SimRequest) -> None:
        out = Outcome(req)
        self.outcomes.append(out)
        self.loop.at(req.arrival_s + self.config.hop_s, self._arrive, Seq(out, next(self._order)))

    def _ended(self, out: Outcome) -> None:
        if self._follow is not None:
            for req in self._follow(out, self.loop.now):
                self.submit(req)

    # ---- the coordinator ----------------------------------------------------------------------
    def _arrive(self, seq: Seq) -> None:
        req = seq.out.req
        why = self.admission.too_big(
            req.prompt_tokens, 0, 0, self._largest_decode_blocks, self.block_size
        )
        if why is not None:
            seq.out.failed = why
            self._ended(seq.out)
            return
        if self._queue or not self._place(seq):
            if not self.admission.can_queue(len(self._queue), decoder_answers=True):
                seq.out.failed = "no decode worker has room and the queue is full (503)"
                self._ended(seq.out)
                return
            heapq.heappush(self._queue, (seq.tier, seq.order, seq))

    def _freed(self, worker: DecodeWorker) -> None:
        while self._queue and self._place(self._queue[0][2]):
            heapq.heappop(self._queue)

    def _place(self, seq: Seq) -> bool:
        """Place ``seq`` if some decode worker has room for its prompt; False if none has."""
        req = seq.out.req
        bs = self.block_size
        need = prompt_blocks(req.prompt_tokens, bs)
        pool = [w for w in self.decodes if w.free_blocks >= need]
        if not pool:
            return False
        if req.prefixes:
            hits = {w.name: w.hit(req.prefixes) for w in pool}
        else:  # nothing to find
            hits = dict.fromkeys((w.name for w in pool), 0)
        if not self.prefills:  # colocated: the least busy (Placement.pick_colocated)
            decode = min(pool, key=lambda w: (w.queued_tokens + w.streams, -w.free_blocks))
            local = True
        else:
            # the local rule reads the best decode hit in ``kv`` mode, none in the others
            # (Placement.decode_hit_tokens), before a decode worker is picked
            by_cache = self.policy.mode is RoutingMode.KV
            best_hit = max(hits.values()) if by_cache else 0
            queue = min(p.queued_tokens for p in self.prefills)
            local = self.local.reason(req.prompt_tokens, best_hit, queue) is not None
            decode = self._pick_decode(need, pool, hits)
        cached = hits[decode.name]  # a worker reserves only what its own cache lacks
        now = self.loop.now
        if local:
            job = PromptJob(seq, max(1, req.prompt_tokens - cached), need, now)
            seq.out.local = True
            seq.out.computed = job.tokens
            decode.prefill_here(job)
            return True
        decode.reserve(need)
        prefill = self._pick_prefill(req)
        computed = max(1, req.prompt_tokens - prefill.hit(req.prefixes))
        job = PromptJob(seq, computed, need, now)
        seq.out.computed = computed
        self._targets[id(job)] = (decode, req.prompt_tokens - cached)
        self.loop.after(2 * self.config.hop_s, prefill.submit, job)
        return True

    def _pick_decode(
        self, need: int, pool: list[DecodeWorker], hits: dict[str, int]
    ) -> DecodeWorker:
        bs = self.block_size
        candidates = [
            Candidate(
                w.name, hit_blocks=hits[w.name] // bs, free_blocks=w.free_blocks, running=w.streams
            )
            for w in pool
        ]
        known = self.config.prefix_cache and any(hits.values())
        pick = self.policy.decode(need, candidates, self._last["decode"], cache_known=known)
        self._last["decode"] = pick.worker_id
        return next(w for w in pool if w.name == pick.worker_id)

    def _pick_prefill(self, req: SimRequest) -> PrefillWorker:
        bs = self.block_size
        by_cache = (
            self.config.prefix_cache and self.policy.mode is RoutingMode.KV and bool(req.prefixes)
        )
        candidates = [
            Candidate(
                p.name,
                hit_blocks=p.hit(req.prefixes) // bs if by_cache else 0,
                queued_tokens=p.queued_tokens,
            )
            for p in self.prefills
        ]
        pick = self.policy.prefill(req.prompt_tokens, bs, candidates, self._last["prefill"])
        self._last["prefill"] = pick.worker_id
        return next(p for p in self.prefills if p.name == pick.worker_id)

    # ---- the split ----------------------------------------------------------------------------
    def _prefilled(self, prefill: PrefillWorker, job: PromptJob) -> None:
        """Token 0 to the gateway, the KV over the prefill worker's link."""
        seq = job.seq
        seq.emit(self.loop.now + self.config.hop_s, self.config.record_gaps)
        decode, tokens = self._targets.pop(id(job))
        link = self.config.link
        start = max(self.loop.now, prefill.link_free_at)
        sent = start + tokens * self.config.kv_bytes_per_token / link.bandwidth
        prefill.link_free_at = sent
        self.loop.at(sent + link.latency_s, self._landed, prefill, decode, job)

    def _landed(self, prefill: PrefillWorker, decode: DecodeWorker, job: PromptJob) -> None:
        prefill.release(job.blocks)
        job.seq.context0 = job.seq.out.req.prompt_tokens
        self.loop.after(self.config.hop_s, decode.kv_landed, job.seq)  # TransferDone

    def _finished(self, seq: Seq) -> None:
        self._ended(seq.out)


def simulate(
    layout: Layout,
    config: SimConfig,
    requests: Iterable[SimRequest],
    decode_profile: Profile,
    prefill_profile: Profile | None = None,
    until: float = float("inf"),
    follow: Follow | None = None,
) -> Run:
    """Run ``requests`` through a cluster of ``layout`` (``follow``: ``Cluster.run``'s)."""
    return Cluster(layout, config, decode_profile, prefill_profile).run(requests, until, follow)
