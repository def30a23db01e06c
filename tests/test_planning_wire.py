"""The planner's wire and gateway parts: samples a gateway measures and sends in its hello,
their bounds, and the plans it shows on /metrics and GET /planner."""

from __future__ import annotations

import pytest

from pdserve.gateway.metrics import GatewayMetrics, Outcome, RunMetrics
from pdserve.gateway.observe.planning import LatencySampler, planner_json
from pdserve.protocol import messages as m
from pdserve.protocol.planning import MAX_SAMPLES, LatencySamples, PlanReport, samples_problem
from tests.gateway_util import parse_prometheus


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_run_metrics_sample_ttft_tpot_and_output_per_choice() -> None:
    metrics, clock = GatewayMetrics(), Clock()
    run = RunMetrics(metrics, clock, clock.now, "tiny")
    clock.now += 0.5
    run.tokens(0, 1)  # first token of the request: ttft 0.5
    clock.now += 0.1
    run.tokens(1, 1)
    clock.now += 0.4
    run.tokens(0, 4)  # choice 0: 5 tokens over 0.5 s after its first
    run.ended(Outcome.SUCCESS)
    (samples,) = metrics.samples.drain()
    assert samples.model == "tiny"
    assert samples.ttft_s == [0.5]
    assert samples.output_tokens == [5, 1]
    assert samples.tpot_s == [pytest.approx(0.5 / 4)]  # choice 1 had one token: no tpot
    assert metrics.samples.drain() == []  # taken once


def test_failed_run_gives_ttft_but_no_output_sample() -> None:
    metrics, clock = GatewayMetrics(), Clock()
    run = RunMetrics(metrics, clock, clock.now, "tiny")
    clock.now += 1.0
    run.tokens(0, 3)
    run.ended(Outcome.ERROR)
    (samples,) = metrics.samples.drain()
    assert (samples.ttft_s, samples.tpot_s, samples.output_tokens) == ([1.0], [], [])


def test_sampler_keeps_the_newest_max_samples() -> None:
    sampler = LatencySampler()
    for i in range(MAX_SAMPLES + 5):
        sampler.first_token("a", float(i))
    sampler.choice_ended("b", 3, 1.0)
    a, b = sampler.drain()
    assert len(a.ttft_s) == MAX_SAMPLES and a.ttft_s[0] == 5.0
    assert (b.model, b.tpot_s, b.output_tokens) == ("b", [0.5], [3])


def test_hello_with_samples_round_trips_and_bounds_are_checked() -> None:
    s = LatencySamples(model="tiny", ttft_s=[0.1, 2.0], tpot_s=[0.03], output_tokens=[7])
    hello = m.GatewayHello("tcp://127.0.0.1:1", [s])
    assert m.decode(m.encode(hello)) == hello
    assert samples_problem(s) is None
    assert "ttft_s" in samples_problem(LatencySamples(model="x", ttft_s=[float("nan")]))
    assert "tpot_s" in samples_problem(LatencySamples(model="x", tpot_s=[-1.0]))
    assert "output_tokens" in samples_problem(LatencySamples(model="x", output_tokens=[-3]))
    too_many = LatencySamples(model="x", ttft_s=[0.0] * (MAX_SAMPLES + 1))
    assert "at most" in samples_problem(too_many)


def test_plans_on_metrics_and_as_json() -> None:
    plan = PlanReport(
        model="tiny",
        prefill=2,
        decode=3,
        max_local_prefill_tokens=256,
        reason="decode: kv use",
        load={"arrival_rate": 1.5, "ttft_p90_s": None},
    )
    state = m.ClusterState(models=[], workers=[], plans=[plan])
    assert m.decode(m.encode(state)) == state
    families = parse_prometheus(GatewayMetrics().render(plans=[plan]))
    assert families["pdserve_planner_desired_workers"][1] == {
        ("pdserve_planner_desired_workers", (("model", "tiny"), ("role", "prefill"))): 2,
        ("pdserve_planner_desired_workers", (("model", "tiny"), ("role", "decode"))): 3,
    }
    assert families["pdserve_planner_max_local_prefill_tokens"][1] == {
        ("pdserve_planner_max_local_prefill_tokens", (("model", "tiny"),)): 256,
    }
    assert families["pdserve_planner_input"][1] == {  # a figure with no sample is left out
        ("pdserve_planner_input", (("model", "tiny"), ("input", "arrival_rate"))): 1.5,
    }
    assert planner_json([plan]) == {
        "models": [
            {
                "model": "tiny",
                "prefill": 2,
                "decode": 3,
                "max_local_prefill_tokens": 256,
                "reason": "decode: kv use",
                "load": {"arrival_rate": 1.5, "ttft_p90_s": None},
            }
        ]
    }
