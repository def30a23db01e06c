"""The hand-written Prometheus registry, checked by a strict text-format parser."""

from __future__ import annotations

import pytest

from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.observe.prometheus import Counter, Gauge, Histogram, Registry
from pdserve.protocol.control import WorkerLoad
from pdserve.protocol.messages import WorkerStatus
from tests.gateway_util import parse_prometheus


def test_exact_text_of_each_kind() -> None:
    r = Registry()
    c = r.add(Counter("jobs_total", "Jobs.", ["outcome"]))
    g = r.add(Gauge("temp", 'Say "hi"\\now.'))
    h = r.add(Histogram("lat_seconds", "Latency.", [0.1, 1.0]))
    c.inc(outcome="ok")
    c.inc(2, outcome='we"ird\n')
    g.set(-1.5)
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert r.render() == (
        "# HELP jobs_total Jobs.\n"
        "# TYPE jobs_total counter\n"
        'jobs_total{outcome="ok"} 1.0\n'
        'jobs_total{outcome="we\\"ird\\n"} 2.0\n'
        '# HELP temp Say "hi"\\\\now.\n'
        "# TYPE temp gauge\n"
        "temp -1.5\n"
        "# HELP lat_seconds Latency.\n"
        "# TYPE lat_seconds histogram\n"
        'lat_seconds_bucket{le="0.1"} 2\n'
        'lat_seconds_bucket{le="1.0"} 3\n'
        'lat_seconds_bucket{le="+Inf"} 4\n'
        "lat_seconds_sum 3.65\n"
        "lat_seconds_count 4\n"
    )
    families = parse_prometheus(r.render())
    assert families["jobs_total"][1][("jobs_total", (("outcome", 'we\\"ird\\n'),))] == 2.0


def test_misuse_is_refused() -> None:
    c = Counter("x_total", "x", ["a"])
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(b="1")
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1, a="1")
    with pytest.raises(ValueError, match="increasing"):
        Histogram("h", "h", [1.0, 0.5])
    r = Registry()
    r.add(Gauge("g", "g"))
    with pytest.raises(ValueError, match="already registered"):
        r.add(Gauge("g", "g"))


def test_gateway_metrics_parse_and_track_workers() -> None:
    m = GatewayMetrics()
    m.requests.inc(model="tiny", outcome="success")
    m.ttft.observe(0.2, model="tiny")
    m.itl.observe(0.01, model="tiny")
    m.e2e.observe(1.5, model="tiny")
    m.prompt_tokens.inc(12)
    m.generation_tokens.inc(30)
    workers = [
        WorkerStatus(role="prefill", worker_id="p0", model="tiny",
                     load=WorkerLoad(free_blocks=90, used_blocks=10, total_blocks=100, running=1,
                                     waiting=2, queued_prompt_tokens=0)),
        WorkerStatus(role="decode", worker_id="d0", model="tiny",
                     load=WorkerLoad(free_blocks=150, used_blocks=50, total_blocks=200, running=7,
                                     waiting=0, queued_prompt_tokens=0)),
    ]  # fmt: skip
    families = parse_prometheus(m.render(workers, {"disaggregated": 3, "local_short_prompt": 2}))
    assert {n: k for n, (k, _) in families.items()} == {
        "pdserve_time_to_first_token_seconds": "histogram",
        "pdserve_inter_token_latency_seconds": "histogram",
        "pdserve_e2e_request_latency_seconds": "histogram",
        "pdserve_requests_total": "counter",
        "pdserve_prompt_tokens_total": "counter",
        "pdserve_generation_tokens_total": "counter",
        "pdserve_gateway_requests_in_flight": "gauge",
        "pdserve_model_state": "gauge",
        "pdserve_kv_blocks_used": "gauge",
        "pdserve_kv_blocks_total": "gauge",
        "pdserve_requests_running": "gauge",
        "pdserve_requests_waiting": "gauge",
        "pdserve_worker_prefix_hit_tokens_total": "counter",
        "pdserve_worker_prefill_tokens_total": "counter",
        "pdserve_worker_preemptions_total": "counter",
        "pdserve_worker_recomputed_tokens_total": "counter",
        "pdserve_kv_blocks_growth": "gauge",
        "pdserve_worker_kv_blocks_sent_total": "counter",
        "pdserve_worker_kv_bytes_sent_total": "counter",
        "pdserve_worker_kv_transfers_failed_total": "counter",
        "pdserve_worker_kv_transfer_seconds": "histogram",
        "pdserve_worker_step_seconds": "histogram",
        "pdserve_worker_step_prefill_tokens": "histogram",
        "pdserve_worker_step_decode_seqs": "histogram",
        "pdserve_worker_steps_over_target_total": "counter",
        "pdserve_worker_tpot_target_seconds": "gauge",
        "pdserve_worker_step_model_seconds": "gauge",
        "pdserve_worker_spec_drafted_tokens_total": "counter",
        "pdserve_worker_spec_accepted_tokens_total": "counter",
        "pdserve_worker_spec_steps_total": "counter",
        "pdserve_worker_spec_draft_tokens_total": "counter",
        "pdserve_worker_spec_draft_prompt_tokens_total": "counter",
        "pdserve_worker_spec_acceptance_rate": "gauge",
        "pdserve_worker_speculative_mode": "gauge",
        "pdserve_routing_decisions_total": "counter",
        "pdserve_planner_desired_workers": "gauge",
        "pdserve_planner_max_local_prefill_tokens": "gauge",
        "pdserve_planner_input": "gauge",
        "pdserve_request_phase_seconds": "histogram",
    }
    assert families["pdserve_routing_decisions_total"][1] == {
        ("pdserve_routing_decisions_total", (("reason", "disaggregated"),)): 3,
        ("pdserve_routing_decisions_total", (("reason", "local_short_prompt"),)): 2,
    }
    used = families["pdserve_kv_blocks_used"][1]
    assert used == {
        ("pdserve_kv_blocks_used", (("role", "decode"), ("worker", "d0"))): 50.0,
        ("pdserve_kv_blocks_used", (("role", "prefill"), ("worker", "p0"))): 10.0,
    }
    ttft = families["pdserve_time_to_first_token_seconds"][1]
    bucket = "pdserve_time_to_first_token_seconds_bucket"
    assert ttft[(bucket, (("model", "tiny"), ("le", "0.1")))] == 0
    assert ttft[(bucket, (("model", "tiny"), ("le", "0.25")))] == 1
    assert families["pdserve_prompt_tokens_total"][1] == {("pdserve_prompt_tokens_total", ()): 12}
    families = parse_prometheus(m.render(workers[1:]))  # p0 left: its series go
    assert len(families["pdserve_requests_waiting"][1]) == 1


def test_each_served_model_shows_its_state() -> None:
    """A model serving degraded (the coordinator's ``ServedModel.degraded``) shows which way;
    one no longer served leaves the gauge."""
    from pdserve.protocol.messages import ServedModel

    def served(name: str, degraded: str = "") -> ServedModel:
        return ServedModel(name=name, root="/m", max_model_len=64, ready=True, degraded=degraded)

    gm = GatewayMetrics()
    text = gm.render(models=[served("a"), served("b", "no_prefill"), served("c", "holding")])
    _, states = parse_prometheus(text)["pdserve_model_state"]
    assert states == {
        ("pdserve_model_state", (("model", "a"), ("state", "ready"))): 1.0,
        ("pdserve_model_state", (("model", "b"), ("state", "no_prefill"))): 1.0,
        ("pdserve_model_state", (("model", "c"), ("state", "holding"))): 1.0,
    }
    _, states = parse_prometheus(gm.render(models=[served("b")]))["pdserve_model_state"]
    assert states == {("pdserve_model_state", (("model", "b"), ("state", "ready"))): 1.0}
