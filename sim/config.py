"""What a simulated cluster is: its layout (``Layout``), the workers' settings (``SimConfig``,
the real flags' defaults), and the link KV moves over (``Link``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.coordinator.policies import MAX_QUEUED, RoutingMode

MODES = ("disagg", "colocated")


def _positive(value: float, name: str, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not (isinstance(value, int | float) and math.isfinite(value) and ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """``disagg``: ``prefill`` prefill workers and ``decode`` decode workers; ``colocated``:
    ``decode`` workers that prefill and decode (``prefill`` 0). A worker is a TP group of
    ``*_tp`` devices."""

    mode: str
    prefill: int
    decode: int
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"layout mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "disagg" and self.prefill < 1:
            raise ValueError(f"a disaggregated layout needs a prefill worker, got {self.prefill}")
        if self.mode == "colocated" and self.prefill != 0:
            raise ValueError("a colocated layout has no prefill workers")
        if self.decode < 1:
            raise ValueError(f"a layout needs a decode (or colocated) worker, got {self.decode}")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("tensor-parallel sizes must be >= 1")

    @property
    def devices(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def describe(self) -> str:
        if self.mode == "colocated":
            return f"colocated {self.decode} x TP{self.decode_tp}"
        return f"disagg {self.prefill}P x TP{self.prefill_tp} + {self.decode}D x TP{self.decode_tp}"


@dataclass(frozen=True)
class Link:
    """KV moves from a prefill worker over its link at ``bandwidth`` bytes/s, one transfer after
    another, each landing ``latency_s`` after its last byte is sent."""

    bandwidth: float = 1e9
    latency_s: float = 1e-3

    def __post_init__(self) -> None:
        _positive(self.bandwidth, "link bandwidth")
        _positive(self.latency_s, "link latency", allow_zero=True)


@dataclass(frozen=True)
class SimConfig:
    """The workers' and the coordinator's settings, as the real flags name them.
    ``kv_bytes_per_token``: what a prompt token's KV weighs in a transfer (the model's);
    ``hop_s``: one message between two processes (gateway, coordinator, worker)."""

    kv_bytes_per_token: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_step_time_s: float = 0.5
    tpot_target_s: float | None = None
    age_bound_s: float = 2.0
    max_local_prefill_tokens: int = 0
    max_prefill_queue_tokens: int = 0
    routing: RoutingMode = RoutingMode.KV
    prefix_cache: bool = True
    max_queued: int = MAX_QUEUED
    link: Link = Link()
    hop_s: float = 5e-4
    record_gaps: bool = False

    def __post_init__(self) -> None:
        _positive(self.kv_bytes_per_token, "kv_bytes_per_token")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_queued"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_local_prefill_tokens", "max_prefill_queue_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        _positive(self.age_bound_s, "age_bound_s")
        _positive(self.hop_s, "hop_s", allow_zero=True)
        if not math.isfinite(self.max_step_time_s):
            raise ValueError(f"max_step_time_s must be a number, got {self.max_step_time_s}")
        if self.tpot_target_s is not None and not math.isfinite(self.tpot_target_s):
            raise ValueError(f"tpot_target_s must be a number, got {self.tpot_target_s}")
