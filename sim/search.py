"""The layout search behind ``pdserve plan``: colocated against disaggregated, each pool's
tensor-parallel size and worker counts, the fewest devices that meet the SLOs (p99 TTFT and
p99 TPOT, every request served), simulated.

    estimate   closed forms per (mode, TP sizes): decode workers from the largest batch whose
               step keeps to the TPOT SLO (and fits the KV), prefill workers from the prompt
               tokens a second at 80% busy; the combinations that look cheapest go on
    slice      a cluster of hundreds of workers is simulated as a slice: 1/g of the workers
               at 1/g of the rate (a Poisson stream thinned is Poisson; placement balances the
               pools), g chosen so the slice holds about SLICE_WORKERS workers; full-scale
               counts are then multiples of g (said in the output)
    search     colocated: the fewest workers that meet the SLOs (up by a quarter until one
               does, then bisect); disaggregated: the fewest decode workers with prefill to
               spare, then the fewest prefill workers with those
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from pdserve.coordinator.profile import Profile
from pdserve.protocol.blocks import blocks_for
from pdserve.sim.cluster import simulate
from pdserve.sim.config import Layout, SimConfig
from pdserve.sim.results import Outcome, Slo, summarize
from pdserve.sim.workload import Workload

SLICE_WORKERS = 128  # workers a simulated slice holds at most (estimated)
SLICE_SMALLEST = 8  # workers of its smaller pool it holds at least (estimated), where it can
PREFILL_BUSY = 0.8  # the estimate's prefill utilisation
TARGET_SHARE = 0.9  # a colocated worker's --tpot-target-ms: this share of the TPOT SLO
WARMUP = 0.2  # of the arrivals' span: requests arriving before are not counted
KEEP = 3  # TP combinations simulated per mode
MAX_SIMS = 400  # a bound on one search


@dataclass(frozen=True)
class Question:
    """What ``plan`` answers: ``profiles`` by TP size (a worker's), the workload, the SLOs;
    ``config.link`` is one device's (a TP group's is its ranks' together)."""

    workload: Workload
    slo: Slo
    profiles: dict[int, Profile]
    config: SimConfig
    modes: tuple[str, ...] = ("colocated", "disagg")
    max_devices: int | None = None
    price_per_device_hour: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ValueError("plan: no profile to plan with")
        if not (self.slo.ttft_s > 0 and self.slo.tpot_s > 0):
            raise ValueError("plan: the SLOs must be > 0 seconds")


@dataclass(frozen=True)
class Verdict:
    """One simulated layout at full scale (``layout``, counts = the slice's × ``scale``)."""

    layout: Layout
    scale: int
    figures: dict[str, Any]
    meets: bool
    binding: str
    tpot_target_s: float | None
    goodput_per_device: float
    cost_per_million_tokens: float | None

    @property
    def goodput(self) -> float:
        return self.goodput_per_device * self.layout.devices

    def to_json(self) -> dict[str, Any]:
        keys = (
            "p50_ttft_ms",
            "p90_ttft_ms",
            "p99_ttft_ms",
            "p50_tpot_ms",
            "p90_tpot_ms",
            "p99_tpot_ms",
            "slo_attainment",
        )
        return {
            "layout": self.layout.describe(),
            "mode": self.layout.mode,
            "prefill_workers": self.layout.prefill,
            "decode_workers": self.layout.decode,
            "prefill_tp": self.layout.prefill_tp if self.layout.prefill else None,
            "decode_tp": self.layout.decode_tp,
            "devices": self.layout.devices,
            "simulated_slice": f"1/{self.scale}",
            "meets_slo": self.meets,
            "binding": self.binding,
            "tpot_target_ms": None if self.tpot_target_s is None else self.tpot_target_s * 1e3,
            "goodput_req_s": self.goodput,
            "goodput_per_device": self.goodput_per_device,
            "cost_per_million_output_tokens": self.cost_per_million_tokens,
            **{k: self.figures.get(k) for k in keys},
        }


@dataclass
class Answer:
    best: list[Verdict]  # the layouts that meet the SLOs, fewest devices first
    tried: int = 0  # simulations run
    notes: list[str] = field(default_factory=list)


# ---- closed-form estimates ---------------------------------------------------------------------


def decode_rate(profile: Profile, prompt: float, output: float, tpot_s: float, most: int) -> float:
    """Output tokens a second one decode worker gives at the largest batch whose step keeps
    to ``tpot_s`` (the KV of the batch's contexts fitting), ``most`` streams at most."""
    context = int(prompt + output / 2)
    fit = max(1, profile.kv_blocks // blocks_for(int(prompt + output) + 1, profile.block_size))
    best = 1
    for batch in range(1, min(most, fit) + 1):
        if profile.decode_step_seconds(batch, context) <= tpot_s:
            best = batch
    return best / profile.decode_step_seconds(best, context)


def estimate(q: Question, mode: str, prefill_tp: int, decode_tp: int) -> tuple[float, float]:
    """(prefill workers, decode workers) the closed forms want at full scale (colocated: 0 and
    the workers for both)."""
    w = q.workload
    rate, prompt, output = w.request_rate(), w.mean_prompt_tokens(), w.mean_output_tokens()
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"plan: the workload's rate is {rate} requests/s: it needs a finite one")
    dprof = q.profiles[decode_tp]
    most = q.config.max_num_seqs
    decode = rate * output / decode_rate(dprof, prompt, output, q.slo.tpot_s * TARGET_SHARE, most)
    if mode == "colocated":
        return 0.0, decode + rate * dprof.prefill_seconds(int(prompt)) / PREFILL_BUSY
    prefill = rate * q.profiles[prefill_tp].prefill_seconds(int(prompt)) / PREFILL_BUSY
    return prefill, decode


# ---- simulating one layout ---------------------------------------------------------------------


class Searcher:
    def __init__(self, q: Question) -> None:
        self.q = q
        self.sims = 0
        self._seen: dict[tuple[Layout, int], Verdict] = {}

    def verdict(self, layout: Layout, scale: int) -> Verdict:
        """``layout`` (a slice) simulated on 1/``scale`` of the workload."""
        key = (layout, scale)
        if key in self._seen:
            return self._seen[key]
        if self.sims >= MAX_SIMS:
            raise RuntimeError(f"plan: more than {MAX_SIMS} simulations; narrow the search")
        self.sims += 1
        q = self.q
        # the question's link is a device's: a prefill group's ranks send their heads at once
        link = replace(q.config.link, bandwidth=q.config.link.bandwidth * layout.prefill_tp)
        config = replace(q.config, link=link)
        target = None
        if layout.mode == "colocated":
            target = q.slo.tpot_s * TARGET_SHARE
            config = replace(config, tpot_target_s=target)
        workload = q.workload if scale == 1 else q.workload.scaled(1 / scale)
        requests = workload.requests(q.seed)
        span = max((r.arrival_s for r in requests), default=0.0)
        run = simulate(
            layout,
            config,
            requests,
            q.profiles[layout.decode_tp],
            q.profiles.get(layout.prefill_tp) if layout.mode == "disagg" else None,
            until=span * 3 + 120.0,
        )
        counted = [o for o in run.outcomes if o.req.arrival_s >= WARMUP * span]
        figures = summarize(counted, q.slo)
        meets, binding = judge(figures, q.slo, counted)
        full = Layout(
            layout.mode,
            layout.prefill * scale,
            layout.decode * scale,
            layout.prefill_tp,
            layout.decode_tp,
        )
        # served within the SLOs a second: the offered rate times the share that met them (the
        # bench's goodput divides by the run's span, which counts the drain at the end)
        goodput = q.workload.request_rate() * figures.get("slo_attainment", 0.0)
        tokens = goodput * q.workload.mean_output_tokens()
        cost = None
        if q.price_per_device_hour is not None and tokens > 0:
            cost = q.price_per_device_hour * full.devices / 3600 / tokens * 1e6
        verdict = Verdict(
            full, scale, figures, meets, binding, target, goodput / full.devices, cost
        )
        self._seen[key] = verdict
        return verdict


def judge(figures: dict[str, Any], slo: Slo, outcomes: list[Outcome]) -> tuple[bool, str]:
    """Whether the run met the SLOs, and the constraint nearest to (or past) its limit."""
    failed = [o for o in outcomes if o.failed]
    if failed or not figures.get("completed"):
        why = failed[0].failed if failed else "nothing completed"
        return False, f"{len(failed)} of {len(outcomes)} requests not served ({why})"
    ttft, tpot = figures["p99_ttft_ms"], figures.get("p99_tpot_ms", 0.0)
    ratios = [
        (ttft / (slo.ttft_s * 1e3), f"TTFT p99 {ttft:.0f} ms of {slo.ttft_s * 1e3:.0f}"),
        (tpot / (slo.tpot_s * 1e3), f"TPOT p99 {tpot:.1f} ms of {slo.tpot_s * 1e3:.0f}"),
    ]
    ratio, text = max(ratios)
    return ratio <= 1.0, text


# ---- the search --------------------------------------------------------------------------------


def fewest(meets: Callable[[int], bool], start: int, limit: int) -> int | None:
    """The smallest n in [1, limit] with ``meets(n)`` (monotone), looking up from ``start`` by a
    quarter at a time, then bisecting; None if even ``limit`` does not."""
    lo, n = 0, max(1, min(start, limit))
    if meets(n):
        hi = n
        while hi > 1 and meets(max(1, hi * 3 // 4)):
            hi = max(1, hi * 3 // 4)
        lo = max(0, hi * 3 // 4) if hi > 1 else 0
    else:
        lo = n
        while True:
            if n >= limit:
                return None
            n = min(limit, max(n + 1, math.ceil(n * 1.25)))
            if meets(n):
                hi = n
                break
            lo = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi


def plan(q: Question, processes: int | None = None) -> Answer:
    """The layouts that meet the SLOs, fewest devices first (then the cheapest). Each (mode,
    TP sizes) is searched apart, in ``processes`` processes (the CPUs here by default; 1: in
    this one)."""
    tasks = []
    tps = sorted(q.profiles)
    for mode in q.modes:
        combos = [(p, d) for p in (tps if mode == "disagg" else [0]) for d in tps]

        def devices(combo: tuple[int, int], mode: str = mode) -> float:
            pre, dec = estimate(q, mode, combo[0] or combo[1], combo[1])
            return pre * combo[0] + dec * combo[1]

        tasks += [(q, mode, p, d) for p, d in sorted(combos, key=devices)[:KEEP]]
    workers = min(len(tasks), processes or os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            results = list(ex.map(_search_task, tasks))
    else:
        results = [_search_task(t) for t in tasks]
    answer = Answer([])
    for (_, mode, pre_tp, dec_tp), (found, sims) in zip(tasks, results, strict=True):
        answer.tried += sims
        if found is not None:
            answer.best.append(found)
        else:
            answer.notes.append(
                f"{mode} TP {pre_tp or ''}{'/' if pre_tp else ''}{dec_tp}: no layout within "
                "the search's bounds meets the SLOs"
            )
    answer.best.sort(key=lambda v: (v.layout.devices, v.cost_per_million_tokens or 0.0))
    if q.max_devices is not None:
        over = [v for v in answer.best if v.layout.devices > q.max_devices]
        answer.best = [v for v in answer.best if v.layout.devices <= q.max_devices]
        if over:
            answer.notes.append(
                f"{len(over)} layout(s) meeting the SLOs need more than {q.max_devices} devices "
                f"(the fewest: {min(v.layout.devices for v in over)})"
            )
    return answer


def _search_task(task: tuple[Question, str, int, int]) -> tuple[Verdict | None, int]:
    """One (mode, TP sizes) searched: its best layout and the simulations it took."""
    q, mode, pre_tp, dec_tp = task
    searcher = Searcher(q)
    return _search(searcher, mode, pre_tp, dec_tp), searcher.sims


def _search(s: Searcher, mode: str, pre_tp: int, dec_tp: int) -> Verdict | None:
    q = s.q
    pre, dec = estimate(q, mode, pre_tp or dec_tp, dec_tp)
    smaller = dec if mode == "colocated" else min(pre, dec)
    scale = max(1, math.floor(smaller / SLICE_SMALLEST), math.ceil((pre + dec) / SLICE_WORKERS))
    try:
        q.workload.scaled(1 / scale)
    except ValueError:
        scale = 1  # bursts that do not divide: the whole cluster
    limit = max(8, 4 * math.ceil((pre + dec) / scale) + 8)
    if mode == "colocated":

        def fits(n: int) -> bool:
            return s.verdict(Layout("colocated", 0, n, 1, dec_tp), scale).meets

        n = fewest(fits, math.ceil(dec / scale), limit)
        return None if n is None else s.verdict(Layout("colocated", 0, n, 1, dec_tp), scale)
    spare = max(1, math.ceil(1.5 * pre / scale) + 1)

    def decode_fits(d: int) -> bool:
        return s.verdict(Layout("disagg", spare, d, pre_tp, dec_tp), scale).meets

    d = fewest(decode_fits, math.ceil(dec / scale), limit)
    if d is None:
        return None

    def prefill_fits(p: int) -> bool:
        return s.verdict(Layout("disagg", p, d, pre_tp, dec_tp), scale).meets

    p = fewest(prefill_fits, math.ceil(pre / scale), spare)
    return None if p is None else s.verdict(Layout("disagg", p, d, pre_tp, dec_tp), scale)
