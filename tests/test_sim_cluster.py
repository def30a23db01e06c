"""The simulator's event engine and workers on cases with known answers (sim/)."""

from __future__ import annotations

import random

import pytest

from pdserve.coordinator.profile import Profile
from pdserve.sim.cluster import Cluster, simulate
from pdserve.sim.config import Layout, Link, SimConfig
from pdserve.sim.events import EventLoop
from pdserve.sim.request import SimRequest
from pdserve.sim.results import Slo, percentile, summarize
from pdserve.sim.steps import StepTimes

MS = 1e-3


def profile(kv_blocks: int = 1000, per_token: float = MS, step: float = 10 * MS) -> Profile:
    """Prefill ``per_token`` a token (no fixed part), decode ``step`` a step whatever the
    batch and context: figures a test can add up by hand."""
    return Profile(
        model="t",
        device="cpu",
        threads=1,
        block_size=16,
        kv_blocks=kv_blocks,
        prefill=((16, 16 * per_token), (4096, 4096 * per_token)),
        decode=((1, 0, step), (64, 0, step), (1, 4096, step)),
    )


def config(**kw: object) -> SimConfig:
    base: dict[str, object] = dict(kv_bytes_per_token=1000, hop_s=0.0, max_step_time_s=0.0)
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_event_loop_runs_in_time_order_ties_in_order_scheduled() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    loop.at(2.0, lambda: seen.append((loop.now, "b")))
    loop.at(1.0, lambda: seen.append((loop.now, "a")))
    loop.at(2.0, lambda: seen.append((loop.now, "c")))
    loop.at(1.0, lambda: loop.after(0.5, lambda: seen.append((loop.now, "d"))))
    loop.run(until=1.9)
    assert seen == [(1.0, "a"), (1.5, "d")]
    loop.run()
    assert seen[2:] == [(2.0, "b"), (2.0, "c")]


def test_mdl_queue_mean_wait() -> None:
    """One prefill worker serving one prompt a step is an M/D/1 queue: the mean wait is
    ρ·D / (2(1 − ρ)) (Pollaczek-Khinchine)."""
    service = 64 * MS  # a 64-token prompt at 1 ms a token, one a step (budget 64 tokens)
    rate = 10.0  # ρ = 0.64
    rng = random.Random(1)
    t, reqs = 0.0, []
    for _ in range(20000):
        t += rng.expovariate(rate)
        reqs.append(SimRequest(t, 64, 1))
    run = simulate(
        Layout("disagg", 1, 1), config(max_num_batched_tokens=64), reqs, profile(), profile()
    )
    waits = [o.ttft - service for o in run.outcomes if o.ttft is not None]
    rho = rate * service
    expected = rho * service / (2 * (1 - rho))
    assert len(waits) == 20000
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.06)


def test_transfer_time_and_token_times() -> None:
    """Token 0 when the prompt is done; the KV lands bytes / bandwidth + latency later; each
    decode step then emits one token."""
    link = Link(bandwidth=1e6, latency_s=2 * MS)
    cfg = config(link=link, hop_s=1 * MS)
    req = SimRequest(0.0, 100, 5)
    run = simulate(Layout("disagg", 1, 1), cfg, [req], profile(), profile())
    (out,) = run.outcomes
    # arrival hop, two hops to the prefill worker, 100 ms of prompt, a hop to the gateway
    assert out.t_first == pytest.approx(1 * MS + 2 * MS + 100 * MS + 1 * MS)
    landed = 3 * MS + 100 * MS + 100 * 1000 / 1e6 + 2 * MS + 1 * MS  # bytes, latency, hop
    assert out.t_last == pytest.approx(landed + 4 * 10 * MS + 1 * MS)
    assert out.tokens == 5 and out.tpot == pytest.approx((out.t_last - out.t_first) / 4)


def test_fixed_batch_step_count_and_blocks_freed() -> None:
    """Eight streams prefilled together on a colocated worker then decoded as one batch: 1 prompt
    step, then 9 decode steps for 10 tokens each."""
    reqs = [SimRequest(0.0, 32, 10) for _ in range(8)]
    cluster = Cluster(Layout("colocated", 0, 1), config(), profile())
    run = cluster.run(reqs)
    stats = run.workers["decode-0"]
    assert stats["steps"] == 1 + 9
    assert stats["prompt_tokens"] == 8 * 32
    assert [o.t_last for o in run.outcomes] == [pytest.approx(256 * MS + 9 * 10 * MS)] * 8
    assert cluster.decodes[0].used_blocks == 0


def test_preemption_recomputes_and_frees_every_block() -> None:
    """A cache too small for every stream's growth: streams are preempted, recomputed, and all
    finish with every block free on every worker."""
    reqs = [SimRequest(0.01 * i, 40, 200, tier=i % 2) for i in range(12)]
    cluster = Cluster(Layout("disagg", 1, 1), config(), profile(kv_blocks=60), profile())
    run = cluster.run(reqs)
    assert all(o.done for o in run.outcomes)
    assert sum(o.preempted for o in run.outcomes) > 0
    assert cluster.decodes[0].used_blocks == 0
    assert cluster.prefills[0].used_blocks == 0
    assert all(o.tokens == 200 for o in run.outcomes)


def test_queue_waits_for_decode_blocks_in_tier_order() -> None:
    """With room for one prompt at a time, the top tier's request goes before an earlier one of
    a lower tier."""
    reqs = [
        SimRequest(0.0, 200, 50),  # takes the cache
        SimRequest(0.01, 200, 5, tier=1),
        SimRequest(0.02, 200, 5, tier=0),
    ]
    run = simulate(Layout("colocated", 0, 1), config(), reqs, profile(kv_blocks=20))
    _, low, high = run.outcomes
    assert high.t_first is not None and low.t_first is not None
    assert high.t_first < low.t_first
    assert all(o.done for o in run.outcomes)


def test_too_big_fails_at_once() -> None:
    run = simulate(Layout("colocated", 0, 1), config(), [SimRequest(0, 400, 4)], profile(20))
    assert "KV cache" in run.outcomes[0].failed


def test_stall_free_steps_keep_the_target() -> None:
    """Streams decoding while a long prompt arrives: with a target the prompt goes in chunks that
    keep every step within it; without one (the old behaviour) a step takes the whole budget."""
    streams = [SimRequest(0.0, 16, 300) for _ in range(4)]
    reqs = [*streams, SimRequest(0.5, 2000, 2)]
    gaps = {}
    for target in (0.05, 0.0):
        cfg = config(tpot_target_s=target, record_gaps=True, max_num_batched_tokens=512)
        run = simulate(Layout("colocated", 0, 1), cfg, reqs, profile())
        gaps[target] = max(g for o in run.outcomes[:4] for g in o.gaps or [])
    assert gaps[0.05] <= 0.05 + 16 * MS + 1e-9  # the room, plus an overdue block at most
    assert gaps[0.0] == pytest.approx(508 * MS, abs=0.02)  # 508 prompt tokens beside 4 streams


def test_conditional_disaggregation_prefills_short_prompts_locally() -> None:
    reqs = [SimRequest(0.1 * i, 20 if i % 2 else 300, 4) for i in range(10)]
    run = simulate(
        Layout("disagg", 1, 1), config(max_local_prefill_tokens=64), reqs, profile(), profile()
    )
    assert [o.local for o in run.outcomes] == [i % 2 == 1 for i in range(10)]


def test_prefix_cache_spares_a_conversations_history() -> None:
    """A second turn finds its first turn's prompt and answer on the decode worker (colocated):
    it computes only its new tokens."""
    first = SimRequest(0.0, 256, 32, key="c/t1")
    second = SimRequest(5.0, 256 + 32 + 64, 8, prefixes=(("c/t1", 288),))
    run = simulate(Layout("colocated", 0, 1), config(), [first, second], profile())
    assert [o.computed for o in run.outcomes] == [256, 352 - 288]
    run = simulate(
        Layout("colocated", 0, 1), config(prefix_cache=False), [first, second], profile()
    )
    assert [o.computed for o in run.outcomes] == [256, 352]


def test_summary_figures() -> None:
    reqs = [SimRequest(0.0, 16, 3), SimRequest(0.0, 16, 1)]
    run = simulate(Layout("colocated", 0, 1), config(), reqs, profile())
    s = summarize(run.outcomes, Slo(ttft_s=1.0, tpot_s=5 * MS))
    assert s["completed"] == 2 and s["failed"] == 0
    assert s["p50_ttft_ms"] == pytest.approx(32.0)  # both prompts in one step
    assert s["p50_tpot_ms"] == pytest.approx(10.0)
    assert s["slo_attainment"] == 0.5  # the one-token request has no TPOT to miss
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_step_times_compose() -> None:
    times = StepTimes(profile())
    assert times.mixed(100, 4, 64) == pytest.approx(10 * MS + 100 * MS - 10 * MS)
    assert times.room(4, 64, 0.05, 2048) == 50
    assert times.budget_tokens(2048, 0.5) == 496  # whole blocks within 0.5 s
    assert times.tpot_target(None) == 0.05


def test_closed_loop_follow_sends_each_next_request_when_one_ends() -> None:
    """A client of concurrency 1: each request is sent when the one before it ends."""
    sent: list[float] = []

    def follow(out: object, now: float) -> list[SimRequest]:
        sent.append(now)
        return [SimRequest(now, 16, 4)] if len(sent) < 3 else []

    run = simulate(
        Layout("colocated", 0, 1), config(), [SimRequest(0.0, 16, 4)], profile(), follow=follow
    )
    assert len(run.outcomes) == 3 and all(o.done for o in run.outcomes)
    assert [o.req.arrival_s for o in run.outcomes[1:]] == sent[:2]
    assert run.outcomes[1].req.arrival_s == run.outcomes[0].t_last


def test_a_prefix_is_looked_up_at_admission_and_cached_as_computed() -> None:
    """Eight prompts sharing a 256-token system prompt sent together to one prefill worker whose
    steps hold 128 tokens: the first computes it, the others find it when they are admitted
    (the real engine looks a prefix up at admission and caches blocks as they are computed)."""
    reqs = [SimRequest(0.0, 320, 2, prefixes=(("sys", 256),)) for _ in range(8)]
    run = simulate(
        Layout("disagg", 1, 1), config(max_num_batched_tokens=128), reqs, profile(), profile()
    )
    assert [o.computed for o in run.outcomes] == [320] + [64] * 7
    assert all(o.done for o in run.outcomes)
