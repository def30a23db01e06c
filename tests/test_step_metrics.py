"""Each worker's engine steps (issue 28 part 2): ``StepCounters`` in every role's heartbeat,
refused by the coordinator when no worker could have sent them, rendered on ``/metrics``.
The end-to-end check through real processes is in test_e2e_serving.py (its cluster)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve.coordinator.counter_checks import counters_problem
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.protocol import messages as m
from pdserve.protocol.control import (
    STEP_DECODE_SEQS_BUCKETS,
    STEP_PREFILL_TOKENS_BUCKETS,
    STEP_SECONDS_BUCKETS,
    Heartbeat,
    StepCounters,
    StepHistogram,
    WorkerCounters,
    WorkerLoad,
)
from pdserve.worker.wire import heartbeat
from tests.cluster_util import Cluster
from tests.engine_util import make_engine, prompts


def counts(bounds: tuple[float, ...], **at: int) -> list[int]:
    """Counts per bucket of ``bounds`` (and one past the last): ``b<i>=n`` puts n in bucket i."""
    out = [0] * (len(bounds) + 1)
    for key, n in at.items():
        out[int(key[1:])] = n
    return out


MIXED = StepHistogram(  # four steps: 2 of at most 50 ms, 1 of at most 100 ms, 1 past 2.5 s
    seconds_counts=counts(STEP_SECONDS_BUCKETS, b3=2, b5=1, b11=1),
    seconds_sum=3.2,
    prefill_tokens_counts=counts(STEP_PREFILL_TOKENS_BUCKETS, b3=3, b10=1),  # 3 of 33..64
    prefill_tokens_sum=5000,
    decode_seqs_counts=counts(STEP_DECODE_SEQS_BUCKETS, b2=4),  # each with 2 streams
    decode_seqs_sum=8,
)
DECODE = StepHistogram(  # one step of 1 stream, at most 5 ms
    seconds_counts=counts(STEP_SECONDS_BUCKETS, b0=1),
    seconds_sum=0.004,
    prefill_tokens_counts=counts(STEP_PREFILL_TOKENS_BUCKETS, b0=1),
    prefill_tokens_sum=0,
    decode_seqs_counts=counts(STEP_DECODE_SEQS_BUCKETS, b1=1),
    decode_seqs_sum=1,
)
STEPS = StepCounters(
    tpot_target_s=0.05,
    model=[0.004, 2e-05, 0.001, 0.15],
    by_kind={"decode": DECODE, "mixed": MIXED},
    over_target={"age_bound": 2},
)
LOAD = WorkerLoad.idle(10)


def status(role: str, worker_id: str, steps: StepCounters) -> m.WorkerStatus:
    counters = WorkerCounters(steps=steps)
    return m.WorkerStatus(role=role, worker_id=worker_id, model="t", load=LOAD, counters=counters)


# ---- the wire --------------------------------------------------------------------------------


def test_steps_round_trip_in_heartbeat_and_cluster_state() -> None:
    beat = Heartbeat(worker_id="d0", load=LOAD, counters=WorkerCounters(steps=STEPS))
    assert m.decode(m.encode(beat)) == beat
    state = m.ClusterState(models=[], workers=[status("decode", "d0", STEPS)])
    back = m.decode(m.encode(state))
    assert isinstance(back, m.ClusterState) and back.workers[0].counters.steps == STEPS


@pytest.mark.parametrize("colocated", [False, True], ids=["prefill+decode", "colocated"])
def test_every_role_reports_its_steps(tiny_dir, colocated: bool) -> None:
    """Through each role's heartbeat (worker/wire.py, encoded as a process sends it) to the
    coordinator's ``ClusterState``: one 21-token prompt, 8 tokens (token 0 from its prefill)."""
    prefill = [] if colocated else [make_engine(tiny_dir)]
    cluster = Cluster(prefill, [make_engine(tiny_dir)], colocated=colocated)
    try:
        spec = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        cluster.submit("r", prompts(512, [21], seed=5)[0], spec)
        cluster.pump()
        assert len(cluster.tokens("r")[0]) == 8
        for wid, w in cluster.workers.items():
            beat = heartbeat(w.engine, wid, w.queued_prompt_tokens, transfers=w.transfers)
            cluster.coordinator.handle(m.decode(m.encode(beat)), time.monotonic())
        state = cluster.coordinator.registry.cluster_state()
        engine_steps = {wid: w.engine.step_counters() for wid, w in cluster.workers.items()}
    finally:
        cluster.close()
    reported = {w.worker_id: w.counters.steps for w in state.workers}
    assert reported == engine_steps  # every role's heartbeat carries its engine's steps
    steps_of = {
        wid: {kind: sum(h.seconds_counts) for kind, h in s.by_kind.items()}
        for wid, s in reported.items()
    }
    if colocated:
        assert steps_of == {"d0": {"prefill": 1, "decode": 7}}
    else:
        assert steps_of == {"p0": {"prefill": 1}, "d0": {"decode": 7}}
    decoder = reported["d0"].by_kind["decode"]
    assert (decoder.prefill_tokens_sum, decoder.decode_seqs_sum) == (0, 7)
    prefiller = reported["d0" if colocated else "p0"].by_kind["prefill"]
    assert (prefiller.prefill_tokens_sum, prefiller.decode_seqs_sum) == (21, 0)


# ---- what the coordinator refuses ------------------------------------------------------------


def test_true_steps_are_accepted() -> None:
    assert counters_problem(WorkerCounters()) is None
    assert counters_problem(WorkerCounters(steps=STEPS)) is None
    no_target = StepCounters(by_kind={"prefill": MIXED})
    assert counters_problem(WorkerCounters(steps=no_target)) is None


def short(name: str, n: int) -> dict[str, object]:
    return {f"{name}_counts": getattr(MIXED, f"{name}_counts")[:n]}


KINDS = "decode, mixed, prefill"
REASONS = "decodes, age_bound, misprediction"
BIG = 1 << 63
REFUSED = [
    ({"tpot_target_s": -0.01}, None, "tpot_target_s=-0.01 is outside [0, 10000]"),
    ({"tpot_target_s": float("nan")}, None, "tpot_target_s=nan is outside [0, 10000]"),
    ({"tpot_target_s": float("inf")}, None, "tpot_target_s=inf is outside [0, 10000]"),
    ({"tpot_target_s": 10000.5}, None, "tpot_target_s=10000.5 is outside [0, 10000]"),
    ({"model": [0.004, 2e-05, 0.001]}, None, "a step model of 3 terms, not 0 or 4"),
    ({"model": [0.0] * 5}, None, "a step model of 5 terms, not 0 or 4"),
    (
        {"model": [0.004, -1e-05, 0.001, 0.0]},
        None,
        "step model=[0.004, -1e-05, 0.001, 0.0]: a term negative or not finite",
    ),
    (
        {"model": [float("inf"), 0.0, 0.0, 0.0]},
        None,
        "step model=[inf, 0.0, 0.0, 0.0]: a term negative or not finite",
    ),
    (
        {"model": [0.0, 0.0, 0.0, float("nan")]},
        None,
        "step model=[0.0, 0.0, 0.0, nan]: a term negative or not finite",
    ),
    ({"over_target": {"slow": 1}}, None, f"over-target reason='slow' is not one of {REASONS}"),
    ({"over_target": {"decodes": -1}}, None, "over_target decodes=-1 is outside [0, 2**63)"),
    (
        {"over_target": {"misprediction": BIG}},
        None,
        f"over_target misprediction={BIG} is outside [0, 2**63)",
    ),
    ({"by_kind": {"chunked": MIXED}}, None, f"step kind='chunked' is not one of {KINDS}"),
    ({}, short("seconds", 11), "mixed steps: 11 seconds buckets, not 12"),
    ({}, {"seconds_counts": [*MIXED.seconds_counts, 0]}, "mixed steps: 13 seconds buckets, not 12"),
    ({}, short("prefill_tokens", 10), "mixed steps: 10 prefill_tokens buckets, not 11"),
    ({}, short("decode_seqs", 0), "mixed steps: 0 decode_seqs buckets, not 11"),
    (
        {},
        {"seconds_counts": counts(STEP_SECONDS_BUCKETS, b4=-1)},
        "mixed steps: a seconds bucket count outside [0, 2**63)",
    ),
    (
        {},
        {"decode_seqs_counts": counts(STEP_DECODE_SEQS_BUCKETS, b10=BIG)},
        "mixed steps: a decode_seqs bucket count outside [0, 2**63)",
    ),
    ({}, {"seconds_sum": -1.0}, "mixed steps: seconds_sum=-1.0"),
    ({}, {"seconds_sum": float("nan")}, "mixed steps: seconds_sum=nan"),
    ({}, {"seconds_sum": float("inf")}, "mixed steps: seconds_sum=inf"),
    ({}, {"seconds_sum": float(BIG)}, f"mixed steps: seconds_sum={float(BIG)}"),
    ({}, {"prefill_tokens_sum": -1}, "mixed steps: prefill_tokens_sum=-1"),
    ({}, {"decode_seqs_sum": BIG}, f"mixed steps: decode_seqs_sum={BIG}"),
]


@pytest.mark.parametrize(("steps", "mixed", "message"), REFUSED)
def test_steps_no_worker_could_send_are_refused(steps: dict, mixed: dict | None, message: str):
    by_kind = {"mixed": dataclasses.replace(MIXED, **mixed)} if mixed else STEPS.by_kind
    bad = dataclasses.replace(STEPS, **{"by_kind": by_kind, **steps})
    assert counters_problem(WorkerCounters(steps=bad)) == message


# ---- what /metrics shows ---------------------------------------------------------------------


def family(text: str, name: str) -> list[str]:
    """The sample lines of metric ``name`` (its _bucket, _sum and _count lines too)."""
    return [
        line
        for line in text.splitlines()
        if line.startswith(name) and line[len(name)] in "{_ " and not line.startswith("#")
    ]


def test_metrics_show_each_workers_steps() -> None:
    untargeted = StepCounters(by_kind={"prefill": DECODE})  # no target, no model
    metrics = GatewayMetrics()
    text = metrics.render([status("decode", "d0", STEPS), status("prefill", "p0", untargeted)])
    d0 = 'role="decode",worker="d0"'
    mixed, decode = f'{d0},kind="mixed"', f'{d0},kind="decode"'
    p0 = 'role="prefill",worker="p0",kind="prefill"'
    bounds = ["0.005", "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.25", "0.5", "1.0"]
    assert family(text, "pdserve_worker_step_seconds") == [
        *(f'pdserve_worker_step_seconds_bucket{{{decode},le="{b}"}} 1' for b in bounds),
        f'pdserve_worker_step_seconds_bucket{{{decode},le="2.5"}} 1',
        f'pdserve_worker_step_seconds_bucket{{{decode},le="+Inf"}} 1',
        f"pdserve_worker_step_seconds_sum{{{decode}}} 0.004",
        f"pdserve_worker_step_seconds_count{{{decode}}} 1",
        *(
            f'pdserve_worker_step_seconds_bucket{{{mixed},le="{b}"}} {n}'
            for b, n in zip(bounds, [0, 0, 0, 2, 2, 3, 3, 3, 3, 3], strict=True)
        ),
        f'pdserve_worker_step_seconds_bucket{{{mixed},le="2.5"}} 3',
        f'pdserve_worker_step_seconds_bucket{{{mixed},le="+Inf"}} 4',
        f"pdserve_worker_step_seconds_sum{{{mixed}}} 3.2",
        f"pdserve_worker_step_seconds_count{{{mixed}}} 4",
        *(f'pdserve_worker_step_seconds_bucket{{{p0},le="{b}"}} 1' for b in bounds),
        f'pdserve_worker_step_seconds_bucket{{{p0},le="2.5"}} 1',
        f'pdserve_worker_step_seconds_bucket{{{p0},le="+Inf"}} 1',
        f"pdserve_worker_step_seconds_sum{{{p0}}} 0.004",
        f"pdserve_worker_step_seconds_count{{{p0}}} 1",
    ]
    tokens = family(text, "pdserve_worker_step_prefill_tokens")
    assert [line for line in tokens if f"{{{mixed}" in line] == [
        f'pdserve_worker_step_prefill_tokens_bucket{{{mixed},le="{b}"}} {n}'
        for b, n in zip(
            [
                "0.0",
                "16.0",
                "32.0",
                "64.0",
                "128.0",
                "256.0",
                "512.0",
                "1024.0",
                "2048.0",
                "4096.0",
                "+Inf",
            ],
            [0, 0, 0, 3, 3, 3, 3, 3, 3, 3, 4],
            strict=True,
        )
    ] + [
        f"pdserve_worker_step_prefill_tokens_sum{{{mixed}}} 5000.0",
        f"pdserve_worker_step_prefill_tokens_count{{{mixed}}} 4",
    ]
    seqs = family(text, "pdserve_worker_step_decode_seqs")
    assert f'pdserve_worker_step_decode_seqs_bucket{{{mixed},le="1.0"}} 0' in seqs
    assert f'pdserve_worker_step_decode_seqs_bucket{{{mixed},le="2.0"}} 4' in seqs
    assert f"pdserve_worker_step_decode_seqs_sum{{{mixed}}} 8.0" in seqs
    assert f'pdserve_worker_step_decode_seqs_bucket{{{decode},le="0.0"}} 0' in seqs
    assert f'pdserve_worker_step_decode_seqs_bucket{{{decode},le="1.0"}} 1' in seqs
    assert len(seqs) == 3 * (len(STEP_DECODE_SEQS_BUCKETS) + 3)  # 3 series: buckets, sum, count
    # a worker with a target shows every reason (0 until a step runs over for it), the target
    # and its model; one without shows none of them
    assert family(text, "pdserve_worker_steps_over_target_total") == [
        f'pdserve_worker_steps_over_target_total{{{d0},reason="age_bound"}} 2.0',
        f'pdserve_worker_steps_over_target_total{{{d0},reason="decodes"}} 0.0',
        f'pdserve_worker_steps_over_target_total{{{d0},reason="misprediction"}} 0.0',
    ]
    assert family(text, "pdserve_worker_tpot_target_seconds") == [
        f"pdserve_worker_tpot_target_seconds{{{d0}}} 0.05"
    ]
    assert family(text, "pdserve_worker_step_model_seconds") == [
        f'pdserve_worker_step_model_seconds{{{d0},term="batched"}} 0.15',
        f'pdserve_worker_step_model_seconds{{{d0},term="fixed"}} 0.004',
        f'pdserve_worker_step_model_seconds{{{d0},term="per_decode_seq"}} 0.001',
        f'pdserve_worker_step_model_seconds{{{d0},term="per_prefill_token"}} 2e-05',
    ]
    (help_line,) = [x for x in text.splitlines() if x.startswith("# HELP pdserve_worker_steps_")]
    assert all(reason in help_line for reason in REASONS.split(", "))  # what an operator reads
    text = metrics.render([status("decode", "d0", StepCounters())])  # p0 left; d0 restarted
    assert not [x for x in text.splitlines() if "_step" in x and not x.startswith("#")]
