"""The gateway's metrics (``GatewayMetrics``, on ``/metrics``): its own requests' latencies,
tokens and outcomes, each request's share recorded by a ``RunMetrics``; and the cluster's
figures as the coordinator last reported them (``ClusterMetrics``). The Prometheus registry
they live in is ``gateway.prometheus``. Every latency and outcome carries the request's
``model``: the served name, a version's own (``chat@v2``, ``gateway.versions``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum

from pdserve.gateway.observe.phases import PhaseMetrics
from pdserve.gateway.observe.planning import LatencySampler, PlannerMetrics
from pdserve.gateway.observe.prometheus import Counter, Gauge, Histogram, Registry
from pdserve.gateway.observe.spec_metrics import SpecMetrics
from pdserve.gateway.observe.step_metrics import StepMetrics
from pdserve.protocol import messages as m
from pdserve.protocol.control import TRANSFER_SECONDS_BUCKETS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Outcome(StrEnum):
    """How a generation request ended: the ``outcome`` label of ``pdserve_requests_total``."""

    SUCCESS = "success"
    ABORTED = "aborted"  # the client left, or a drain ended it
    ERROR = "error"
    TIMEOUT = "timeout"
    REJECTED = "rejected"  # 429 or 503 before it ran
    INVALID = "invalid"  # any other 4xx


class GatewayMetrics:
    """Every metric the gateway exposes: this gateway's requests here, the cluster's in
    ``cluster``."""

    def __init__(self) -> None:
        self.registry = r = Registry()
        self.ttft = r.add(
            Histogram(
                "pdserve_time_to_first_token_seconds",
                "Time from request arrival to its first token.",
                LATENCY_BUCKETS,
                ["model"],
            )
        )
        self.itl = r.add(
            Histogram(
                "pdserve_inter_token_latency_seconds",
                "Time between consecutive tokens of one choice.",
                TOKEN_LATENCY_BUCKETS,
                ["model"],
            )
        )
        self.e2e = r.add(
            Histogram(
                "pdserve_e2e_request_latency_seconds",
                "Time from request arrival to its last token.",
                LATENCY_BUCKETS,
                ["model"],
            )
        )
        self.requests = r.add(
            Counter(
                "pdserve_requests_total",
                "Requests by outcome: success, aborted, error, timeout, rejected (429/503), "
                "invalid (4xx).",
                ["model", "outcome"],
            )
        )
        self.prompt_tokens = r.add(
            Counter("pdserve_prompt_tokens_total", "Prompt tokens of admitted requests.")
        )
        self.generation_tokens = r.add(
            Counter("pdserve_generation_tokens_total", "Tokens generated and streamed.")
        )
        self.in_flight = r.add(
            Gauge("pdserve_gateway_requests_in_flight", "Generation requests in this gateway.")
        )
        self.model_state = r.add(
            Gauge(
                "pdserve_model_state",
                "1 for the state each served model is in: ready; no_prefill (no live prefill "
                "worker: its decode workers prefill too); holding (no worker can decode it: "
                "requests wait up to the coordinator's --hold-timeout).",
                ["model", "state"],
            )
        )
        self.cluster = ClusterMetrics(r)
        self.planner = PlannerMetrics(r)
        self.samples = LatencySampler()  # what the next hello tells the planner
        self.phases = PhaseMetrics(r)  # where each request's time went

    def answered(self, model: str, outcome: Outcome, failed: bool) -> None:
        """A generation request ended, or was refused before it ran (``model`` "": before its
        model was known); ``failed``: by the server's fault (an error, a timeout, a 5xx), what
        the canary gate counts."""
        self.requests.inc(model=model, outcome=outcome.value)
        if model:
            self.samples.request_ended(model, failed)

    def render(
        self,
        stats: Iterable[m.WorkerStatus] = (),
        routing: Mapping[str, int] | None = None,
        plans: Iterable[m.PlanReport] = (),
        models: Iterable[m.ServedModel] = (),
    ) -> str:
        self.cluster.set(stats, routing or {})
        self.planner.set(list(plans))
        self.model_state.clear()  # the models served now, as the coordinator last told
        for served in models:
            self.model_state.set(1, model=served.name, state=served.degraded or "ready")
        return self.registry.render()


class ClusterMetrics:
    """The workers' load and totals (their engine steps in ``steps``, their speculative
    decoding in ``spec``) and the coordinator's routing decisions, as it last reported them
    (``ClusterState``): replaced wholesale at each render, so a worker that left disappears."""

    def __init__(self, r: Registry) -> None:
        worker = ["role", "worker"]
        self.kv_used = r.add(Gauge("pdserve_kv_blocks_used", "KV blocks in use.", worker))
        self.kv_total = r.add(Gauge("pdserve_kv_blocks_total", "KV blocks in all.", worker))
        self.running = r.add(Gauge("pdserve_requests_running", "Requests running.", worker))
        self.waiting = r.add(Gauge("pdserve_requests_waiting", "Requests queued.", worker))
        self.prefix_hits = r.add(
            Counter(
                "pdserve_worker_prefix_hit_tokens_total",
                "Prompt tokens whose KV the worker's prefix cache already held.",
                worker,
            )
        )
        self.prefill_computed = r.add(
            Counter(
                "pdserve_worker_prefill_tokens_total",
                "Tokens the worker computed in prompt chunks (recomputation included).",
                worker,
            )
        )
        self.preemptions = r.add(
            Counter(
                "pdserve_worker_preemptions_total",
                "Sequences whose KV blocks a step took back when the cache ran out, to be "
                "recomputed (every token kept).",
                worker,
            )
        )
        self.recomputed = r.add(
            Counter(
                "pdserve_worker_recomputed_tokens_total",
                "Tokens whose KV was computed again after a preemption (not billed).",
                worker,
            )
        )
        self.kv_growth = r.add(
            Gauge(
                "pdserve_kv_blocks_growth",
                "KV blocks the worker's sequences are expected to take still as they decode.",
                worker,
            )
        )
        self.kv_blocks_sent = r.add(
            Counter(
                "pdserve_worker_kv_blocks_sent_total", "KV blocks pushed to decode workers.", worker
            )
        )
        self.kv_bytes_sent = r.add(
            Counter(
                "pdserve_worker_kv_bytes_sent_total", "KV bytes pushed to decode workers.", worker
            )
        )
        self.kv_transfers_failed = r.add(
            Counter(
                "pdserve_worker_kv_transfers_failed_total",
                "KV pushes that failed (timed out, refused, a broken link) or could not start.",
                worker,
            )
        )
        self.transfer_time = r.add(
            Histogram(
                "pdserve_worker_kv_transfer_seconds",
                "Time from the start of a KV push to its end (done or failed).",
                TRANSFER_SECONDS_BUCKETS,
                worker,
            )
        )
        self.steps = StepMetrics(r)  # what each worker's engine steps were
        self.spec = SpecMetrics(r)  # what each worker's speculative decoding drafted and kept
        self.routing = r.add(
            Counter(
                "pdserve_routing_decisions_total",
                "The coordinator's route for each choice: disaggregated, local_short_prompt and "
                "local_prefill_busy (prefilled on its decode worker), colocated; and its prefill "
                "worker for each: prefill_kv_hit, prefill_kv_miss, prefill_hot_spot_guard, "
                "prefill_load, prefill_round_robin.",
                ["reason"],
            )
        )

    def set(self, stats: Iterable[m.WorkerStatus], routing: Mapping[str, int]) -> None:
        self.set_workers(stats)
        self.routing.clear()  # the coordinator's own totals, as it last reported them
        for reason, count in routing.items():
            self.routing.inc(count, reason=reason)

    def set_workers(self, stats: Iterable[m.WorkerStatus]) -> None:
        gauges = (self.kv_used, self.kv_total, self.running, self.waiting, self.kv_growth)
        totals = (
            self.prefix_hits,
            self.prefill_computed,
            self.preemptions,
            self.recomputed,
            self.kv_blocks_sent,
            self.kv_bytes_sent,
            self.kv_transfers_failed,
        )
        for metric in (*gauges, *totals, self.transfer_time):
            metric.clear()
        self.steps.clear()
        self.spec.clear()
        for s in stats:
            labels = {"role": s.role, "worker": s.worker_id}
            load = s.load
            figures = (
                load.used_blocks,
                load.total_blocks,
                load.running,
                load.waiting,
                load.growth_blocks,
            )
            for gauge, value in zip(gauges, figures, strict=True):
                gauge.set(value, **labels)
            # the workers' own totals, as they last reported them
            c = s.counters
            counts = (
                c.prefix_hit_tokens,
                c.prefill_tokens,
                c.preemptions,
                c.recomputed_tokens,
                c.kv_blocks_sent,
                c.kv_bytes_sent,
                c.kv_transfers_failed,
            )
            for counter, count in zip(totals, counts, strict=True):
                counter.inc(count, **labels)
            if c.transfer_seconds_counts:
                self.transfer_time.set_counts(
                    c.transfer_seconds_counts, c.transfer_seconds_sum, **labels
                )
            self.steps.set(c.steps, s.role, s.worker_id)
            self.spec.set(c.spec, s.role, s.worker_id)


class RunMetrics:
    """What one request adds to ``GatewayMetrics`` (none: nothing): its prompt tokens once
    admitted, the time to its first token, the gaps between each choice's tokens, the tokens
    streamed, and its outcome, with its whole latency when it succeeded; and, for the planner,
    its ``model``'s samples (time to first token, each choice's tokens and time per token)."""

    def __init__(
        self,
        metrics: GatewayMetrics | None,
        clock: Callable[[], float],
        arrival: float,
        model: str = "",
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._arrival = arrival
        self._model = model
        self._first_token_at: float | None = None
        self._last_token_at: dict[int, float] = {}  # choice -> its last update's time
        self._choice_first: dict[int, float] = {}  # choice -> its first update's time
        self._choice_tokens: dict[int, int] = {}

    def admitted(self, prompt_tokens: int) -> None:
        if self._metrics is not None:
            self._metrics.prompt_tokens.inc(prompt_tokens)

    def tokens(self, choice: int, num_tokens: int) -> None:
        """``num_tokens`` more of ``choice`` streamed, now."""
        if self._metrics is None:
            return
        now = self._clock()
        if self._first_token_at is None:
            self._first_token_at = now
            self._metrics.ttft.observe(now - self._arrival, model=self._model)
            if self._model:
                self._metrics.samples.first_token(self._model, now - self._arrival)
        self._choice_first.setdefault(choice, now)
        self._choice_tokens[choice] = self._choice_tokens.get(choice, 0) + num_tokens
        # The tokens of one update share the time since the choice's previous update; after
        # the choice's first token, its batch-mates arrived with it (out-of-order arrivals).
        last = self._last_token_at.get(choice)
        gaps = (
            [0.0] * (num_tokens - 1) if last is None else [(now - last) / num_tokens] * num_tokens
        )
        for gap in gaps:
            self._metrics.itl.observe(gap, model=self._model)
        self._last_token_at[choice] = now
        self._metrics.generation_tokens.inc(num_tokens)

    def ended(self, outcome: Outcome) -> None:
        if self._metrics is not None:
            failed = outcome in (Outcome.ERROR, Outcome.TIMEOUT)
            self._metrics.answered(self._model, outcome, failed)
            if outcome is Outcome.SUCCESS:
                self._metrics.e2e.observe(self._clock() - self._arrival, model=self._model)
                self._sample_choices()

    def _sample_choices(self) -> None:
        if self._metrics is None or not self._model:
            return
        for choice, tokens in self._choice_tokens.items():
            decode_s = self._last_token_at[choice] - self._choice_first[choice]
            self._metrics.samples.choice_ended(self._model, tokens, decode_s)
