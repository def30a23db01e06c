"""The workers' engine steps on ``/metrics`` (``StepMetrics``, a part of
``metrics.ClusterMetrics``): each worker's ``StepCounters`` as it last reported them, by kind
of step (``STEP_KINDS``). engine/step_stats.py says how an operator reads them."""

from __future__ import annotations

from pdserve.gateway.observe.prometheus import Counter, Gauge, Histogram, Registry
from pdserve.protocol.control import (
    OVER_TARGET_REASONS,
    STEP_DECODE_SEQS_BUCKETS,
    STEP_MODEL_TERMS,
    STEP_PREFILL_TOKENS_BUCKETS,
    STEP_SECONDS_BUCKETS,
    StepCounters,
)

_KINDS_HELP = (
    "by kind of step: decode (decode tokens only), mixed (decode tokens and prompt chunks: the "
    "steps a TPOT target caps), prefill (prompt chunks only)"
)


class StepMetrics:
    """Owns the step metrics of every worker; ``clear`` then ``set`` each worker at each render
    (a worker that left disappears)."""

    def __init__(self, r: Registry) -> None:
        by_kind = ["role", "worker", "kind"]
        self.seconds = r.add(
            Histogram(
                "pdserve_worker_step_seconds",
                f"How long the worker's engine steps took, {_KINDS_HELP}. Slow decode steps: "
                "more streams than the TPOT target allows.",
                STEP_SECONDS_BUCKETS,
                by_kind,
            )
        )
        self.prefill_tokens = r.add(
            Histogram(
                "pdserve_worker_step_prefill_tokens",
                f"Prompt tokens an engine step computed, {_KINDS_HELP}. Slow mixed steps with "
                "many prompt tokens: prompts let in beside the streams.",
                STEP_PREFILL_TOKENS_BUCKETS,
                by_kind,
            )
        )
        self.decode_seqs = r.add(
            Histogram(
                "pdserve_worker_step_decode_seqs",
                f"Streams (decode sequences) an engine step advanced, {_KINDS_HELP}.",
                STEP_DECODE_SEQS_BUCKETS,
                by_kind,
            )
        )
        self.over_target = r.add(
            Counter(
                "pdserve_worker_steps_over_target_total",
                "Engine steps carrying decodes that ran over the worker's TPOT target, by "
                "reason: decodes (its decodes alone were predicted over it: too many streams), "
                "age_bound (a prompt that went the age bound without a token was let in), "
                "misprediction (predicted within it: the step-time model was off, or the "
                "machine busy).",
                ["role", "worker", "reason"],
            )
        )
        self.tpot_target = r.add(
            Gauge(
                "pdserve_worker_tpot_target_seconds",
                "What a worker's engine step carrying decodes should take (its TPOT target); "
                "absent: the worker has none.",
                ["role", "worker"],
            )
        )
        self.model = r.add(
            Gauge(
                "pdserve_worker_step_model_seconds",
                "The worker's step-time model now, by term: a step is predicted to take fixed "
                "+ per_prefill_token x prompt tokens + per_decode_seq x decode sequences "
                "(+ batched, for a step of more than a row or two) seconds; compare with "
                "pdserve_worker_step_seconds.",
                ["role", "worker", "term"],
            )
        )

    def clear(self) -> None:
        for metric in (self.seconds, self.prefill_tokens, self.decode_seqs):
            metric.clear()
        for valued in (self.over_target, self.tpot_target, self.model):
            valued.clear()

    def set(self, steps: StepCounters, role: str, worker: str) -> None:
        """One worker's steps, as it last reported them (the coordinator checked their
        shapes: ``coordinator.counter_checks``)."""
        for kind, h in steps.by_kind.items():
            labels = {"role": role, "worker": worker, "kind": kind}
            self.seconds.set_counts(h.seconds_counts, h.seconds_sum, **labels)
            self.prefill_tokens.set_counts(h.prefill_tokens_counts, h.prefill_tokens_sum, **labels)
            self.decode_seqs.set_counts(h.decode_seqs_counts, h.decode_seqs_sum, **labels)
        # a worker with a target shows every reason, at 0 until a step runs over for it
        over = dict.fromkeys(OVER_TARGET_REASONS, 0) if steps.tpot_target_s > 0 else {}
        for reason, count in (over | steps.over_target).items():
            self.over_target.inc(count, role=role, worker=worker, reason=reason)
        if steps.tpot_target_s > 0:
            self.tpot_target.set(steps.tpot_target_s, role=role, worker=worker)
        if len(steps.model) == len(STEP_MODEL_TERMS):
            for term, seconds in zip(STEP_MODEL_TERMS, steps.model, strict=True):
                self.model.set(seconds, role=role, worker=worker, term=term)
