"""The committed experiments as the simulator replays them: each real run's workload rebuilt
with the bench's own generators and seeds (what the clients sent), each arm's layout and flags
as the script started it (as of the code of the day it ran), and the figures the real run
reports, computed the same way from the simulated requests.

    disagg_vs_colocated   mixed workload (harness: arrivals.schedule, datasets.burst_times,
                          seed = stage index), 4 arms, 3 rates; the disagg arm's threshold is
                          the planner's (``AutoThreshold``: the flag defaulted to auto)
    stall_gap             4 streams, then 2 x 2,400-token prompts once each stream has 8 tokens
    kv_routing            multi-turn, a closed loop (``Conversations``: 8 in flight, next turn
                          when an answer is back), 4 warm-up first turns before it
    autoscale_trace       the fixed arm: autoscale_trace.build_trace (needs the tokenizer: its
                          prompts draw from the same generator), the local-prefill threshold
                          the poller recorded, replayed at its times

Nothing here reads a clock or the network; every run is deterministic."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any  # the committed results are JSON

import numpy as np

from pdserve.bench.arrivals import schedule
from pdserve.bench.datasets import BenchRequest, MixedSpec, burst_times
from pdserve.bench.experiments.sim_clients import Conversations, Stages
from pdserve.bench.harness import num_requests
from pdserve.coordinator.demand import Load, Targets, local_prefill_threshold
from pdserve.coordinator.policies import ConditionalDisaggPolicy, RoutingMode
from pdserve.coordinator.profile import Profile
from pdserve.sim.cluster import Cluster, Run
from pdserve.sim.config import Layout, Link, SimConfig
from pdserve.sim.request import SimRequest
from pdserve.sim.results import Outcome, Slo, percentile, summarize

KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, float32 KV: 46,080 bytes
# zmq + CURVE (serve's default backend): bench/results/transfer_ttft.json, 2,048 tokens'
# KV (94.4 MB) in 0.714 s on this host
LINK = Link(bandwidth=2048 * KV_BYTES_PER_TOKEN / 0.714, latency_s=1e-3)
HOP_S = 1e-3  # one message between two processes sharing two busy cores
POLL_S = 0.05  # stall_gap's client polls this often (its cue and its window's end)
Figures = dict[str, float]


def config(**kw: Any) -> SimConfig:
    return SimConfig(
        kv_bytes_per_token=KV_BYTES_PER_TOKEN, link=LINK, hop_s=HOP_S, record_gaps=True, **kw
    )


def run_cluster(
    layout: Layout,
    cfg: SimConfig,
    requests: list[SimRequest],
    profile: Profile,
    setup: Callable[[Cluster, list[SimRequest]], None] | None = None,
    until: float = math.inf,
    follow: Callable[[Outcome, float], Iterable[SimRequest]] | None = None,
) -> Run:
    """One run; ``setup`` may schedule its own events on the cluster's loop first (the
    planner's threshold: the simulator has no planner)."""
    cluster = Cluster(layout, cfg, profile, profile if layout.mode == "disagg" else None)
    if setup is not None:
        setup(cluster, requests)
    return cluster.run(requests, until, follow)


def bench_figures(outcomes: Sequence[Outcome], slo: Slo) -> Figures:
    """The bench's keys, renamed as the report names figures."""
    s = summarize(outcomes, slo)
    names = {
        "ttft_p50_ms": "p50_ttft_ms",
        "ttft_p90_ms": "p90_ttft_ms",
        "ttft_p99_ms": "p99_ttft_ms",
        "tpot_p50_ms": "p50_tpot_ms",
        "tpot_p90_ms": "p90_tpot_ms",
        "tpot_p99_ms": "p99_tpot_ms",
        "itl_p99_ms": "p99_itl_ms",
        "goodput_rps": "request_goodput",
    }
    return {name: float(s[key]) for name, key in names.items() if key in s}


# ---- the planner's local-prefill threshold ----------------------------------------------------
@dataclass
class AutoThreshold:
    """``--max-local-prefill-tokens auto``: every ``interval_s`` the coordinator's planner sets
    the threshold from the load over its window (coordinator/planning.py ``load``,
    coordinator/demand.py ``local_prefill_threshold``), with the model's shipped profile and
    the default targets. The load is read from the simulated cluster as it is (the real
    planner reads heartbeats); the window starts empty at the first arrival."""

    profile: Profile
    targets: Targets = field(default_factory=Targets)
    interval_s: float = 5.0
    window_s: float = 30.0
    cap: int = 4096
    seen: list[tuple[float, int]] = field(default_factory=list)

    def __call__(self, cluster: Cluster, requests: list[SimRequest]) -> None:
        def tick() -> None:
            now = cluster.loop.now
            load = self._load(cluster, now)
            limit = local_prefill_threshold(self.profile, self.targets, load, self.cap)
            cluster.local = ConditionalDisaggPolicy(limit, cluster.config.max_prefill_queue_tokens)
            self.seen.append((now, limit))
            if cluster.loop.pending:  # anything else still to happen
                cluster.loop.after(self.interval_s, tick)

        cluster.loop.at(0.0, tick)

    def _load(self, cluster: Cluster, now: float) -> Load:
        since = now - self.window_s
        recent = [o.req for o in cluster.outcomes if since < o.req.arrival_s <= now]
        outputs = [o.tokens for o in cluster.outcomes if o.done and since < (o.t_last or 0) <= now]
        outputs = outputs or [r.output_tokens for r in recent]
        decodes = cluster.decodes
        return Load(
            arrival_rate=len(recent) / self.window_s,
            prompt_tokens=statistics.fmean(r.prompt_tokens for r in recent) if recent else 0.0,
            output_tokens=statistics.fmean(outputs) if outputs else 0.0,
            prefill_queue_tokens=sum(p.queued_tokens for p in cluster.prefills),
            decode_running=sum(d.streams for d in decodes),
            decode_waiting=0,
            kv_used_blocks=sum(d.used_blocks for d in decodes),
            kv_total_blocks=sum(d.total_blocks for d in decodes),
            ttft_p90_s=None,
            tpot_p90_s=None,
            prefill_workers=len(cluster.prefills),
            decode_workers=len(decodes),
        )


def recorded_threshold(
    samples: list[dict[str, Any]],
) -> Callable[[Cluster, list[SimRequest]], None]:
    """The threshold the autoscale trace's poller read each second, set at its times."""
    points = [(s["t"], int(s["max_local_prefill_tokens"])) for s in samples]

    def setup(cluster: Cluster, requests: list[SimRequest]) -> None:
        def put(limit: int) -> None:
            cluster.local = ConditionalDisaggPolicy(limit, 0)

        put(points[0][1])
        for t, limit in points[1:]:
            cluster.loop.at(t, put, limit)

    return setup


# ---- disagg_vs_colocated: the mixed workload --------------------------------------------------
DVC_ARMS: dict[str, tuple[Layout, dict[str, Any]]] = {
    "disagg": (Layout("disagg", 1, 1), {}),
    "conditional": (Layout("disagg", 1, 1), {}),
    "colocated": (Layout("colocated", 0, 2), {}),
    "colocated-stall": (Layout("colocated", 0, 2), {"tpot_target_s": 0.0}),
}


def mixed_workload(w: dict[str, Any], rate: float, seed: int) -> list[SimRequest]:
    """What ``pdserve bench --dataset mixed`` sent at ``rate``: streams by the run's arrival
    process (a fresh generator of the stage's seed, as runner.run_requests), bursts at their
    fixed times, nothing at or past ``duration`` (the runner stops sending there)."""
    spec = MixedSpec(
        w["stream_input_len"],
        w["stream_output_len"],
        w["burst_input_len"],
        w["burst_output_len"],
        w["burst_size"],
        w["burst_interval"],
    )
    n = num_requests(argparse.Namespace(num_prompts=None, duration=w["duration"]), rate)
    stream = BenchRequest("", spec.stream_output_len, spec.stream_input_len, kind="stream")
    bursts = [
        BenchRequest("", spec.burst_output_len, spec.burst_input_len, kind="burst", at=t)
        for t in burst_times(spec, w["duration"])
        for _ in range(spec.burst_size)
    ]
    timed = schedule([stream] * n + bursts, rate, 1.0, np.random.default_rng(seed))
    return [
        SimRequest(t, r.prompt_len, r.max_tokens, kind=r.kind)
        for t, r in timed
        if t < w["duration"]
    ]


def dvc_arm(
    arm: str, w: dict[str, Any], planner: Profile | None
) -> tuple[Layout, SimConfig, AutoThreshold | None]:
    """An arm's layout, settings and (the disagg arm, whose flag was left at auto) the
    planner's threshold; ``planner=None``: that arm at threshold 0 instead."""
    layout, extra = DVC_ARMS[arm]
    target = (w["tpot_target_ms"] or w["slo_tpot_ms"]) / 1e3
    kw: dict[str, Any] = {"tpot_target_s": target, **extra}
    if arm == "conditional":
        kw["max_local_prefill_tokens"] = w["local_prefill_tokens"]
    auto = AutoThreshold(planner) if arm == "disagg" and planner is not None else None
    return layout, config(**kw), auto


def dvc_run(
    arm: str,
    w: dict[str, Any],
    rates: Sequence[float],
    warmup: int,
    profile: Profile,
    planner: Profile | None,
) -> tuple[list[Figures], Run, AutoThreshold | None]:
    """One arm as its server ran: the warm-up's streams, then each rate (seed: its stage's
    index) once the one before is back; each rate's figures over its own requests."""
    layout, cfg, auto = dvc_arm(arm, w, planner)
    stream = SimRequest(0.0, w["stream_input_len"], w["stream_output_len"], kind="stream")
    stages = Stages([stream] * warmup, [mixed_workload(w, rate, i) for i, rate in enumerate(rates)])
    run = run_cluster(layout, cfg, stages.first(), profile, auto, follow=stages.follow)
    slo = Slo(ttft_s=w["slo_ttft_ms"] / 1e3, tpot_s=w["slo_tpot_ms"] / 1e3)
    figures = []
    for i in range(len(rates)):
        outs = [o for o in run.outcomes if stages.stage_of[id(o.req)] == i]
        streams = [o for o in outs if o.req.kind == "stream"]
        local = sum(o.local for o in streams) / len(streams)
        figures.append(bench_figures(outs, slo) | {"local_stream_share": local})
    return figures, run, auto


# ---- stall_gap ------------------------------------------------------------------------------
def token_times(o: Outcome) -> list[float]:
    """When each of the request's tokens reached the gateway (gaps recorded)."""
    if o.t_first is None:
        return []
    return [o.t_first, *(o.t_first + g for g in itertools.accumulate(o.gaps or []))]


def stall_gap_run(args: dict[str, Any], target_s: float, profile: Profile) -> Figures:
    """One arm: the streams decode; once every stream has 8 tokens (the client's cue, found
    by a first run of the streams alone: the runs are the same up to it) the prompts go; the
    streams' gaps that overlap [cue, both prompts' first token] (at most ``window`` s)."""
    layout, cfg = Layout("colocated", 0, 1), config(tpot_target_s=target_s)
    streams = [SimRequest(0.0, 32, 4000, kind="stream") for _ in range(args["streams"])]
    alone = run_cluster(layout, cfg, streams, profile, until=30.0)
    cue = max(token_times(o)[7] for o in alone.outcomes) + POLL_S / 2
    prompts = [SimRequest(cue, args["prompt_len"], 1, kind="prompt")] * args["prompts"]
    run = run_cluster(layout, cfg, streams + prompts, profile, until=cue + args["window"])
    firsts = sorted(o.t_first for o in run.outcomes if o.req.kind == "prompt" and o.t_first)
    done = len(firsts) == args["prompts"]
    end = firsts[-1] + POLL_S / 2 if done else cue + args["window"]
    gaps = [
        (b - a) * 1e3
        for o in run.outcomes
        if o.req.kind == "stream"
        for a, b in zip(token_times(o), token_times(o)[1:], strict=False)
        if b > cue and a < end
    ]
    ttft = [(t - cue) * 1e3 for t in firsts] + [math.nan] * (args["prompts"] - len(firsts))
    return {
        "gap_p50_ms": percentile(gaps, 50),
        "gap_p99_ms": percentile(gaps, 99),
        "gap_max_ms": max(gaps),
        "prompt_ttft_first_ms": ttft[0],
        "prompt_ttft_second_ms": ttft[-1],
    }


def stall_gap_real(rounds: list[dict[str, Any]]) -> tuple[Figures, dict[str, list[float]]]:
    """The real arm's figures (medians over rounds) and each round's."""
    per: dict[str, list[float]] = {
        "gap_p50_ms": [r["gap_p50_ms"] for r in rounds],
        "gap_p99_ms": [r["gap_p99_ms"] for r in rounds],
        "gap_max_ms": [r["gap_max_ms"] for r in rounds],
        "prompt_ttft_first_ms": [min(r["prompt_ttft_ms"]) for r in rounds],
        "prompt_ttft_second_ms": [max(r["prompt_ttft_ms"]) for r in rounds],
    }
    return {k: statistics.median(v) for k, v in per.items()}, per


# ---- kv_routing: the multi-turn closed loop ---------------------------------------------------
def kv_routing_run(w: dict[str, Any], arm: str, profile: Profile, local_tokens: int) -> Figures:
    """One arm: turns 3+ median TTFT and TPOT and the share of their prompt tokens not
    computed; prompt tokens computed over every turn and the warm-up (the workers' totals)."""
    convs = Conversations(
        w["conversations"],
        w["turns"],
        w["system_len"],
        w["user_len"],
        w["output_len"],
        w["concurrency"],
        w["warmup"],
    )
    cfg = config(
        routing=RoutingMode.parse(arm),
        max_local_prefill_tokens=local_tokens,
        tpot_target_s=0.0,  # 2026-11-23: before the TPOT target (stall-free steps) existed
    )
    run = run_cluster(Layout("disagg", 2, 2), cfg, convs.first(), profile, follow=convs.follow)
    late = [o for o in run.outcomes if o.req.kind in {f"turn{t}" for t in range(3, 99)}]
    done = [o for o in late if o.done]
    prompt = sum(o.req.prompt_tokens for o in late)
    return {
        "ttft_p50_ms": percentile([o.ttft * 1e3 for o in done if o.ttft is not None], 50),
        "tpot_p50_ms": percentile([o.tpot * 1e3 for o in done if o.tpot is not None], 50),
        "cached_fraction": 1 - sum(o.computed for o in late) / prompt,
        "prefill_tokens": float(sum(o.computed for o in run.outcomes)),
        "turns3_prompt_tokens": float(prompt),
        "local_share": sum(o.local for o in run.outcomes) / len(run.outcomes),
    }


# ---- autoscale_trace: the fixed arm -----------------------------------------------------------
def trace_figures(
    ttft_s: Sequence[float | None], tpot_s: Sequence[float | None], slo: Slo
) -> Figures:
    """TTFT and TPOT percentiles over the requests that have them, and the share of all
    requests meeting both SLOs (a failed one, TTFT None, misses)."""
    ttft = [t * 1e3 for t in ttft_s if t is not None]
    tpot = [t * 1e3 for t in tpot_s if t is not None]
    met = sum(
        a is not None and a <= slo.ttft_s and (b or 0.0) <= slo.tpot_s
        for a, b in zip(ttft_s, tpot_s, strict=True)
    )
    figures = {f"ttft_p{q}_ms": percentile(ttft, q) for q in (50, 90, 99)}
    figures |= {f"tpot_p{q}_ms": percentile(tpot, q) for q in (50, 90, 99)}
    return figures | {"attainment": met / len(ttft_s)}


def autoscale_real(rounds: list[dict[str, Any]], slo: Slo) -> list[Figures]:
    """Each round's figures from its per-request rows [start, kind, phase, TTFT, TPOT, err]."""
    return [
        trace_figures([p[3] for p in r["per_request"]], [p[4] for p in r["per_request"]], slo)
        for r in rounds
    ]


def autoscale_fixed_run(
    trace: list[BenchRequest], samples: list[dict[str, Any]], profile: Profile, slo: Slo
) -> Figures:
    """The fixed arm (1P1D, one thread each, 1,024 KV blocks a worker; 2026-11-25 12:42:
    before the TPOT target existed) over one round's trace, its threshold as recorded."""
    requests = [SimRequest(r.at or 0.0, r.prompt_len, r.max_tokens, kind=r.kind) for r in trace]
    cfg = config(tpot_target_s=0.0)
    profile = dataclasses.replace(profile, kv_blocks=1024)  # --num-kv-blocks=1024
    run = run_cluster(Layout("disagg", 1, 1), cfg, requests, profile, recorded_threshold(samples))
    outs = run.outcomes
    return trace_figures([o.ttft for o in outs], [o.tpot for o in outs], slo)


def medians(rows: Sequence[Figures]) -> Figures:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}
