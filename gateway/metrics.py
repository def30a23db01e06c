"""A small Prometheus registry (text exposition format 0.0.4) and the gateway's metrics."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from pdserve.gateway.backend import WorkerStats
from pdserve.protocol import messages as m

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

LabelValues = tuple[str, ...]
M = TypeVar("M", bound="_Metric")


def format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        help_text = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {help_text}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> list[str]:
        raise NotImplementedError


class _Valued(_Metric):
    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[LabelValues, float] = {}
        self.clear()

    def clear(self) -> None:
        self._values = {} if self.labelnames else {(): 0.0}

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def samples(self) -> list[str]:
        return [
            f"{self.name}{_labels(self.labelnames, k)} {format_value(v)}"
            for k, v in sorted(self._values.items())
        ]


class Counter(_Valued):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter only goes up, got {amount}")
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Valued):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self._values[self._key(labels)] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help: str, buckets: Sequence[float], labelnames: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help, labelnames)
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"{name}: buckets must be increasing and distinct, got {buckets}")
        self.buckets = [*[float(b) for b in buckets if b != math.inf], math.inf]
        self._counts: dict[LabelValues, list[int]] = {}
        self._sums: dict[LabelValues, float] = {}
        if not labelnames:
            self._counts[()], self._sums[()] = [0] * len(self.buckets), 0.0

    def clear(self) -> None:
        """Forget every labelled series (for figures replaced wholesale, as ``set_counts``)."""
        if self.labelnames:
            self._counts, self._sums = {}, {}

    def set_counts(self, counts: Sequence[int], total: float, **labels: str) -> None:
        """A series from totals kept elsewhere: ``counts`` per bucket (not cumulative)."""
        if len(counts) != len(self.buckets):
            raise ValueError(f"{self.name}: {len(self.buckets)} buckets, got {len(counts)}")
        key = self._key(labels)
        self._counts[key], self._sums[key] = list(counts), float(total)

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        counts = self._counts.setdefault(key, [0] * len(self.buckets))
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                counts[i] += 1
                break
        self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, **labels: str) -> int:
        return sum(self._counts.get(self._key(labels), []))

    def samples(self) -> list[str]:
        lines = []
        for key, counts in sorted(self._counts.items()):
            cumulative = 0
            for upper, n in zip(self.buckets, counts, strict=True):
                cumulative += n
                labels = _labels((*self.labelnames, "le"), (*key, format_value(upper)))
                lines.append(f"{self.name}_bucket{labels} {cumulative}")
            labels = _labels(self.labelnames, key)
            lines.append(f"{self.name}_sum{labels} {format_value(self._sums[key])}")
            lines.append(f"{self.name}_count{labels} {cumulative}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def add(self, metric: M) -> M:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} is already registered")
        self._metrics[metric.name] = metric
        return metric

    def render(self) -> str:
        lines = []
        for metric in self._metrics.values():
            lines += metric.header() + metric.samples()
        return "\n".join(lines) + "\n"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = Registry()
        self.ttft = r.add(
            Histogram(
                "pdserve_time_to_first_token_seconds",
                "Time from request arrival to its first token.",
                LATENCY_BUCKETS,
            )
        )
        self.itl = r.add(
            Histogram(
                "pdserve_inter_token_latency_seconds",
                "Time between consecutive tokens of one choice.",
                TOKEN_LATENCY_BUCKETS,
            )
        )
        self.e2e = r.add(
            Histogram(
                "pdserve_e2e_request_latency_seconds",
                "Time from request arrival to its last token.",
                LATENCY_BUCKETS,
            )
        )
        self.requests = r.add(
            Counter(
                "pdserve_requests_total",
                "Requests by outcome: success, aborted, error, timeout, rejected (429/503), "
                "invalid (4xx).",
                ["outcome"],
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
        self.transfer_time = r.add(
            Histogram(
                "pdserve_worker_kv_transfer_seconds",
                "Time from the start of a KV push to its end (done or failed).",
                m.TRANSFER_SECONDS_BUCKETS,
                worker,
            )
        )
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

    def set_workers(self, stats: Iterable[WorkerStats]) -> None:
        """Replace the per-worker gauges, so a worker that left disappears."""
        gauges = (self.kv_used, self.kv_total, self.running, self.waiting)
        totals = (self.prefix_hits, self.prefill_computed, self.kv_blocks_sent, self.kv_bytes_sent)
        for metric in (*gauges, *totals, self.transfer_time):
            metric.clear()
        for s in stats:
            values = (s.kv_blocks_used, s.kv_blocks_total, s.requests_running, s.requests_waiting)
            for gauge, value in zip(gauges, values, strict=True):
                gauge.set(value, role=s.role, worker=s.worker)
            # the workers' own totals, as they last reported them
            c = s.counters
            counts = (c.prefix_hit_tokens, c.prefill_tokens, c.kv_blocks_sent, c.kv_bytes_sent)
            for counter, count in zip(totals, counts, strict=True):
                counter.inc(count, role=s.role, worker=s.worker)
            if c.transfer_seconds_counts:
                self.transfer_time.set_counts(
                    c.transfer_seconds_counts, c.transfer_seconds_sum, role=s.role, worker=s.worker
                )

    def render(
        self, stats: Iterable[WorkerStats] = (), routing: Mapping[str, int] | None = None
    ) -> str:
        self.set_workers(stats)
        self.routing.clear()  # the coordinator's own totals, as it last reported them
        for reason, count in (routing or {}).items():
            self.routing.inc(count, reason=reason)
        return self.registry.render()
