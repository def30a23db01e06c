"""Where a request's time went (protocol/phases.py) and its trace through the roles, in one
process: which chunk carries which worker's phases, on the disaggregated and the colocated
path, and each role's span under the context it was handed (runtime/tracing.py)."""

from __future__ import annotations

import math
import time

import pytest

from pdserve.protocol import messages as m
from pdserve.protocol.phases import MAX_PHASE_S, Phase, checked
from pdserve.runtime.tracing import Attributes, SpanKind, Tracer, parse_traceparent
from tests.cluster_util import Cluster
from tests.engine_util import greedy, make_engine, prompts

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
GATEWAY_SPAN = "00f067aa0ba902b7"


class Recorder(Tracer):
    """A tracer that is on and keeps its spans (service, trace, span, parent, name, attrs)."""

    enabled = True

    def __init__(self, service: str, spans: list[tuple]) -> None:
        self.service, self.spans = service, spans

    def record(
        self,
        trace_id: str,
        span_id: str,
        parent_span_id: str,
        name: str,
        start: float,
        end: float,
        attributes: Attributes,
        kind: SpanKind,
    ) -> None:
        assert start <= end
        self.spans.append((self.service, trace_id, span_id, parent_span_id, dict(attributes)))


@pytest.fixture
def clusters(tiny_dir):
    made: list[Cluster] = []

    def make(colocated: bool = False) -> Cluster:
        prefill = [] if colocated else [make_engine(tiny_dir, max_num_batched_tokens=32)]
        c = Cluster(prefill, [make_engine(tiny_dir)], colocated=colocated)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def submit(cluster: Cluster, request_id: str, prompt: list[int], trace: str = "") -> None:
    generate = m.Generate(
        request_id=request_id,
        model="tiny",
        prompt_token_ids=prompt,
        sampling=greedy(3),
        n=1,
        stream_address="gw",
        trace=trace,
    )
    cluster.bus.queue.append(("coordinator", generate))


def phases_by_index(cluster: Cluster) -> dict[int, dict[str, float]]:
    return {c.index: c.phases for c in cluster.chunks() if c.phases}


def test_disaggregated_chunks_carry_each_workers_phases(clusters) -> None:
    cluster = clusters()
    begun = time.monotonic()
    submit(cluster, "r0", prompts(512, [40])[0])  # two chunks of 32: two prefill steps
    cluster.pump()
    wall = time.monotonic() - begun
    phases = phases_by_index(cluster)
    # token 0's chunk (the prefill worker's, with the coordinator's), then token 1's (the
    # decode worker's, with the prefill worker's push)
    assert {i: sorted(p) for i, p in phases.items()} == {
        0: ["coordinator_wait", "prefill_compute", "prefill_queue"],
        1: ["first_decode_step", "kv_transfer"],
    }
    assert [c.index for c in cluster.chunks() if c.phases] == [0, 1]  # no other chunk
    values = [s for p in phases.values() for s in p.values()]
    assert all(s >= 0 for s in values) and sum(values) <= wall
    assert phases[0]["prefill_compute"] > 0 and phases[1]["first_decode_step"] > 0


def test_colocated_has_no_transfer_phase(clusters) -> None:
    cluster = clusters(colocated=True)
    submit(cluster, "r0", prompts(512, [40])[0])
    cluster.pump()
    phases = phases_by_index(cluster)
    assert {i: sorted(p) for i, p in phases.items()} == {
        0: ["prefill_compute", "prefill_queue"],
        1: ["first_decode_step"],  # no kv_transfer (nothing moved), no coordinator_wait
    }


def test_each_role_adds_its_span_under_the_context_it_was_handed(clusters) -> None:
    cluster = clusters()
    spans: list[tuple] = []
    cluster.coordinator.shared.tracer = Recorder("coordinator", spans)
    for wid, worker in cluster.workers.items():
        worker.tracer = Recorder(wid, spans)
    submit(cluster, "r0", prompts(512, [20])[0], f"00-{TRACE_ID}-{GATEWAY_SPAN}-01")
    cluster.pump()
    by_role = {service: rest for service, *rest in spans}
    assert sorted(by_role) == ["coordinator", "d0", "p0"]  # one span each
    trace_id, coordinator_span, parent, _ = by_role["coordinator"]
    assert (trace_id, parent) == (TRACE_ID, GATEWAY_SPAN)
    for worker in ("p0", "d0"):
        trace_id, span_id, parent, attributes = by_role[worker]
        assert (trace_id, parent) == (TRACE_ID, coordinator_span)
        assert span_id not in (coordinator_span, GATEWAY_SPAN)
        assert attributes["pdserve.request_id"] == "r0"
        assert attributes["pdserve.worker"] == worker


def test_a_role_with_tracing_off_passes_the_context_on(clusters) -> None:
    cluster = clusters()
    spans: list[tuple] = []
    for wid, worker in cluster.workers.items():  # the coordinator's tracer is off
        worker.tracer = Recorder(wid, spans)
    submit(cluster, "r0", prompts(512, [20])[0], f"00-{TRACE_ID}-{GATEWAY_SPAN}-01")
    submit(cluster, "r1", prompts(512, [20])[0], f"00-{TRACE_ID}-{GATEWAY_SPAN}-00")
    cluster.pump()
    # r1 is not sampled: no span; r0's workers' spans hang under the gateway's
    assert sorted((s[0], s[1], s[3], s[4]["pdserve.request_id"]) for s in spans) == [
        ("d0", TRACE_ID, GATEWAY_SPAN, "r0"),
        ("p0", TRACE_ID, GATEWAY_SPAN, "r0"),
    ]


def test_the_coordinator_hands_on_the_span_it_records() -> None:
    spans: list[tuple] = []
    tracer = Recorder("coordinator", spans)
    parent = f"00-{TRACE_ID}-{GATEWAY_SPAN}-01"
    handed = parse_traceparent(tracer.child(parent, "r0#0"))
    tracer.span("coordinator", parent, 1.0, 2.0, {}, salt="r0#0")
    assert handed is not None and handed.trace_id == TRACE_ID
    assert spans == [("coordinator", TRACE_ID, handed.span_id, GATEWAY_SPAN, {})]
    assert tracer.child(parent, "r0#1") != tracer.child(parent, "r0#0")
    assert Tracer().child(parent, "r0#0") == parent  # off: passed on as it came


def test_checked_keeps_known_finite_bounded_phases() -> None:
    given = {
        "prefill_queue": 0.25,
        "kv_transfer": -0.5,  # a clock stepping back: 0
        "first_decode_step": math.nan,
        "prefill_compute": math.inf,
        "coordinator_wait": MAX_PHASE_S * 2,
        "made_up": 1.0,
    }
    assert checked(given) == {Phase.PREFILL_QUEUE: 0.25, Phase.KV_TRANSFER: 0.0}
    assert checked(None) == {}
