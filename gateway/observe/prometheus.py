"""A small Prometheus registry: counters, gauges and histograms, rendered in the text exposition
format 0.0.4 (``CONTENT_TYPE``). Nothing here knows what the gateway measures (``metrics``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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

    def total(self, **labels: str) -> float:
        """The sum over every series with these labels (the others any value)."""
        idx = [(self.labelnames.index(name), value) for name, value in labels.items()]
        return sum(v for k, v in self._values.items() if all(k[i] == x for i, x in idx))

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
    """Metrics by name, rendered in the order they were added."""

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
