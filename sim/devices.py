"""Devices' figures: what a roofline profile (sim/derive.py) and the simulator's links need.

The catalog holds public datasheet figures (NVIDIA datasheets for the H100 SXM, H200 SXM,
A100 SXM 80GB, L40S and HGX B200): dense bf16 tensor throughput (the datasheets' headline
figures are "with sparsity", twice these), HBM bandwidth, memory as sold (GB = 1e9 bytes),
NVLink (or PCIe) bandwidth one direction per device, and one 400 Gb/s (200 Gb/s on the
older parts) network adapter per device between nodes. A device not in the catalog is built
with ``parse_device`` ("h100,mem_bw=4e12" or every figure named).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

# What a Profile's device field accepts (coordinator/profile.py), less its ":<index>" suffix.
_NAME = re.compile(r"[a-z][a-z0-9]{0,15}")
# field -> highest value accepted (all must be > 0)
_BOUNDS = {
    "flops": 1e18,
    "mem_bw": 1e15,
    "mem_bytes": 1e14,
    "link_bw": 1e14,
    "net_bw": 1e14,
    "link_latency_s": 1.0,
    "net_latency_s": 1.0,
}
MAX_DEVICES_PER_NODE = 1024


@dataclass(frozen=True)
class Device:
    """One accelerator's figures, in bytes, seconds and FLOP/s."""

    name: str  # "h100": lower-case letters and digits, as a Profile's device
    flops: float  # dense bf16/fp16 FLOP/s (no sparsity)
    mem_bw: float  # bytes/s of device memory (HBM)
    mem_bytes: float  # device memory
    link_bw: float  # bytes/s one direction per device within a node (NVLink, else PCIe)
    net_bw: float  # bytes/s per device between nodes (400 Gb/s InfiniBand = 50e9)
    link_latency_s: float = 5e-6  # one hop within a node
    net_latency_s: float = 1e-5  # one hop between nodes
    devices_per_node: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"device name: {str(self.name)[:40]!r} is not 1-16 lower-case letters and "
                "digits starting with a letter"
            )
        for field, high in _BOUNDS.items():
            value = getattr(self, field)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and 0 < value <= high)
            ):
                raise ValueError(f"device {field}: {value!r} is not a number in (0, {high:g}]")
        n = self.devices_per_node
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DEVICES_PER_NODE:
            raise ValueError(
                f"device devices_per_node: {n!r} is not an integer in [1, {MAX_DEVICES_PER_NODE}]"
            )


# Source: NVIDIA datasheets (H100 Tensor Core GPU, H200, A100 80GB, L40S, DGX/HGX B200).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # SXM5: 1979 TFLOP/s bf16 with sparsity; HBM3 3.35 TB/s; NVLink 4 900 GB/s both ways.
        # 80e9 bytes as sold, a little under what the part reports (about 85e9);
        # Efficiency.memory_utilization takes its share of this figure.
        Device("h100", flops=989e12, mem_bw=3.35e12, mem_bytes=80e9, link_bw=450e9, net_bw=50e9),
        # the H100's compute with HBM3e: 141 GB at 4.8 TB/s
        Device("h200", flops=989e12, mem_bw=4.8e12, mem_bytes=141e9, link_bw=450e9, net_bw=50e9),
        # SXM 80GB: HBM2e 2.039 TB/s; NVLink 3 600 GB/s both ways; 200 Gb/s HDR InfiniBand
        Device("a100", flops=312e12, mem_bw=2.039e12, mem_bytes=80e9, link_bw=300e9, net_bw=25e9),
        # PCIe card, no NVLink: PCIe Gen4 x16 is 32 GB/s a direction, and a hop costs more
        Device(
            "l40s",
            flops=362e12,
            mem_bw=0.864e12,
            mem_bytes=48e9,
            link_bw=32e9,
            net_bw=25e9,
            link_latency_s=1e-5,
        ),
        # 4.5 PFLOP/s bf16 with sparsity; HBM3e 8 TB/s; NVLink 5 1.8 TB/s both ways. The part
        # carries 192 GB; HGX/DGX B200 datasheets give 180 GB a GPU (1,440 GB for 8): that one.
        Device("b200", flops=2.25e15, mem_bw=8e12, mem_bytes=180e9, link_bw=900e9, net_bw=50e9),
    )
}


def device(name: str) -> Device:
    """The catalog's device ``name``; ``ValueError`` naming the known ones otherwise."""
    found = DEVICES.get(name)
    if found is None:
        raise ValueError(f"unknown device {name[:40]!r}: known devices are {', '.join(DEVICES)}")
    return found


def parse_device(spec: str) -> Device:
    """A device from ``"h100"``, ``"h100,mem_bw=4e12,name=h100x"`` (a catalog device with some
    figures changed) or ``"name=x,flops=...,mem_bw=...,mem_bytes=...,link_bw=...,net_bw=..."``
    (every figure named; the latencies and ``devices_per_node`` have defaults)."""
    parts = [p.strip() for p in spec.split(",")]
    base = None if "=" in parts[0] else device(parts[0])
    fields: dict[str, Any] = {}
    for part in parts if base is None else parts[1:]:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in Device.__dataclass_fields__:
            raise ValueError(
                f"device spec: {part[:40]!r} is not <field>=<value> with a field among "
                f"{', '.join(Device.__dataclass_fields__)}"
            )
        if key in fields:
            raise ValueError(f"device spec: {key} given twice")
        fields[key] = _value(key, value.strip())
    if base is not None:
        return dataclasses.replace(base, **fields)
    missing = [k for k in ("name", *_BOUNDS) if k not in fields and "latency" not in k]
    if missing:
        raise ValueError(f"device spec: missing {', '.join(missing)} (or start with a known one)")
    return Device(**fields)


def _value(key: str, text: str) -> Any:
    if key == "name":
        return text
    try:
        return int(text) if key == "devices_per_node" else float(text)
    except ValueError:
        kind = "an integer" if key == "devices_per_node" else "a number"
        raise ValueError(f"device {key}: {text[:40]!r} is not {kind}") from None
