"""Each worker's speculative decoding: ``SpecCounters`` in its heartbeat, refused by the
coordinator when no worker could have sent them, rendered on ``/metrics``
(gateway/observe/spec_metrics.py)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.coordinator.counter_checks import counters_problem
from pdserve.coordinator.registry import figures_problem
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, SpecCounters, WorkerCounters, WorkerLoad
from tests.gateway_util import parse_prometheus

SPEC = SpecCounters(
    mode="draft",
    drafted=[40, 30, 10],  # 40 first drafts, 30 second, 10 third
    accepted=[30, 15, 5],  # 50 of 80 kept
    steps={"speculated": 12, "not_worth": 3},
    draft_tokens=500,
    draft_prompt_tokens=320,
)
LOAD = WorkerLoad.idle(10)


def status(role: str, worker_id: str, spec: SpecCounters) -> m.WorkerStatus:
    counters = WorkerCounters(spec=spec)
    return m.WorkerStatus(role=role, worker_id=worker_id, model="t", load=LOAD, counters=counters)


# ---- the wire --------------------------------------------------------------------------------


def test_spec_round_trips_in_heartbeat_and_cluster_state() -> None:
    beat = Heartbeat(worker_id="d0", load=LOAD, counters=WorkerCounters(spec=SPEC))
    assert m.decode(m.encode(beat)) == beat
    state = m.ClusterState(models=[], workers=[status("decode", "d0", SPEC)])
    back = m.decode(m.encode(state))
    assert isinstance(back, m.ClusterState) and back.workers[0].counters.spec == SPEC


# ---- what the coordinator refuses ------------------------------------------------------------


def test_true_spec_counters_are_accepted() -> None:
    assert counters_problem(WorkerCounters(spec=SPEC)) is None
    assert counters_problem(WorkerCounters(spec=SpecCounters())) is None  # off: all empty
    # more drafts at a later position than an earlier one is not refused
    rising = SpecCounters(mode="ngram", drafted=[5, 7], accepted=[5, 7])
    assert counters_problem(WorkerCounters(spec=rising)) is None
    full = SpecCounters(mode="ngram", drafted=[1] * 16, accepted=[0] * 16)
    assert counters_problem(WorkerCounters(spec=full)) is None
    no_prompt = dataclasses.replace(SPEC, draft_prompt_tokens=0)  # draft KV came with a prefill
    assert counters_problem(WorkerCounters(spec=no_prompt)) is None


BIG = 1 << 63
REASONS = "speculated, no_drafts, not_worth, no_room, switched_off"
REFUSED = [
    ({"mode": "eagle"}, "speculative mode='eagle' is not one of off, ngram, draft"),
    ({"mode": "x" * 60}, f"speculative mode={'x' * 40!r} is not one of off, ngram, draft"),
    ({"accepted": [30, 15]}, "3 drafted positions but 2 accepted"),
    ({"drafted": [1] * 17, "accepted": [0] * 17}, "17 draft positions, more than 16"),
    ({"drafted": [40, -1, 10]}, "draft position 2: a count outside [0, 2**63)"),
    ({"accepted": [30, 15, BIG]}, "draft position 3: a count outside [0, 2**63)"),
    ({"accepted": [41, 15, 5]}, "draft position 1: 41 accepted of 40 drafted"),
    ({"steps": {"lucky": 1}}, f"speculative step reason='lucky' is not one of {REASONS}"),
    (
        {"steps": {"y" * 50: 1}},
        f"speculative step reason={'y' * 40!r} is not one of {REASONS}",
    ),
    ({"steps": {"no_room": -1}}, "speculative steps no_room=-1 is outside [0, 2**63)"),
    ({"steps": {"speculated": BIG}}, f"speculative steps speculated={BIG} is outside [0, 2**63)"),
    ({"draft_tokens": -5}, "draft_tokens=-5 is outside [0, 2**63)"),
    ({"draft_prompt_tokens": BIG}, f"draft_prompt_tokens={BIG} is outside [0, 2**63)"),
    ({"draft_prompt_tokens": 501}, "draft_prompt_tokens=501 > draft_tokens=500"),
]


@pytest.mark.parametrize(("change", "message"), REFUSED)
def test_spec_no_worker_could_send_is_refused(change: dict, message: str) -> None:
    bad = dataclasses.replace(SPEC, **change)
    assert counters_problem(WorkerCounters(spec=bad)) == message
    # the coordinator refuses the whole heartbeat, with that reason
    beat = Heartbeat(worker_id="d0", load=LOAD, counters=WorkerCounters(spec=bad))
    assert figures_problem(beat, LOAD.total_blocks) == message


# ---- what /metrics shows ---------------------------------------------------------------------


def family(text: str, name: str) -> list[str]:
    """The sample lines of metric ``name``."""
    return [
        line
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in "{ " and not line.startswith("#")
    ]


def test_metrics_show_each_workers_speculation() -> None:
    ngram = SpecCounters(mode="ngram", steps={"no_drafts": 4})  # nothing drafted yet
    metrics = GatewayMetrics()
    workers = [
        status("decode", "d0", SPEC),
        status("decode", "d1", ngram),
        status("prefill", "p0", SpecCounters()),  # off: shows nothing
    ]
    text = metrics.render(workers)
    parse_prometheus(text)  # the strict text format, every series once
    d0, d1 = 'role="decode",worker="d0"', 'role="decode",worker="d1"'
    assert family(text, "pdserve_worker_spec_drafted_tokens_total") == [
        f'pdserve_worker_spec_drafted_tokens_total{{{d0},position="1"}} 40.0',
        f'pdserve_worker_spec_drafted_tokens_total{{{d0},position="2"}} 30.0',
        f'pdserve_worker_spec_drafted_tokens_total{{{d0},position="3"}} 10.0',
    ]
    assert family(text, "pdserve_worker_spec_accepted_tokens_total") == [
        f'pdserve_worker_spec_accepted_tokens_total{{{d0},position="1"}} 30.0',
        f'pdserve_worker_spec_accepted_tokens_total{{{d0},position="2"}} 15.0',
        f'pdserve_worker_spec_accepted_tokens_total{{{d0},position="3"}} 5.0',
    ]
    # a worker that speculates shows every reason, at 0 until a step counts for it
    assert family(text, "pdserve_worker_spec_steps_total") == [
        f'pdserve_worker_spec_steps_total{{{d0},reason="no_drafts"}} 0.0',
        f'pdserve_worker_spec_steps_total{{{d0},reason="no_room"}} 0.0',
        f'pdserve_worker_spec_steps_total{{{d0},reason="not_worth"}} 3.0',
        f'pdserve_worker_spec_steps_total{{{d0},reason="speculated"}} 12.0',
        f'pdserve_worker_spec_steps_total{{{d0},reason="switched_off"}} 0.0',
        f'pdserve_worker_spec_steps_total{{{d1},reason="no_drafts"}} 4.0',
        f'pdserve_worker_spec_steps_total{{{d1},reason="no_room"}} 0.0',
        f'pdserve_worker_spec_steps_total{{{d1},reason="not_worth"}} 0.0',
        f'pdserve_worker_spec_steps_total{{{d1},reason="speculated"}} 0.0',
        f'pdserve_worker_spec_steps_total{{{d1},reason="switched_off"}} 0.0',
    ]
    assert family(text, "pdserve_worker_spec_draft_tokens_total") == [
        f"pdserve_worker_spec_draft_tokens_total{{{d0}}} 500.0",
        f"pdserve_worker_spec_draft_tokens_total{{{d1}}} 0.0",
    ]
    assert family(text, "pdserve_worker_spec_draft_prompt_tokens_total") == [
        f"pdserve_worker_spec_draft_prompt_tokens_total{{{d0}}} 320.0",
        f"pdserve_worker_spec_draft_prompt_tokens_total{{{d1}}} 0.0",
    ]
    # 50 of 80 drafts kept; d1 has drafted none, so it has no rate
    assert family(text, "pdserve_worker_spec_acceptance_rate") == [
        f"pdserve_worker_spec_acceptance_rate{{{d0}}} 0.625"
    ]
    assert family(text, "pdserve_worker_speculative_mode") == [
        f'pdserve_worker_speculative_mode{{{d0},mode="draft"}} 1.0',
        f'pdserve_worker_speculative_mode{{{d1},mode="ngram"}} 1.0',
    ]
    assert 'worker="p0"' not in "\n".join(x for x in text.splitlines() if "_spec" in x)
    (help_line,) = [x for x in text.splitlines() if x.startswith("# HELP pdserve_worker_spec_st")]
    assert all(reason in help_line for reason in REASONS.split(", "))  # what an operator reads
    assert "# TYPE pdserve_worker_spec_drafted_tokens_total counter" in text
    assert "# TYPE pdserve_worker_spec_acceptance_rate gauge" in text
    # d0 left, d1 switched off: nothing of theirs stays
    text = metrics.render([status("decode", "d1", SpecCounters())])
    assert not [x for x in text.splitlines() if "spec" in x and not x.startswith("#")]
