"""Batch-1 decode memory-bandwidth utilisation (MBU): weight bytes read per step over the step
time, against the read bandwidth this machine measures now.

A batch-1 decode step reads every weight once, so ``weight_bytes / TPOT`` is the bandwidth a
server used; the floor of TPOT is ``weight_bytes / read_bandwidth``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch


def read_bandwidth(threads: int, gib: float = 1.0, rounds: int = 5) -> float:
    """Bytes/s a sum over a ``gib`` GiB float32 tensor reads with ``threads`` torch threads
    (median of ``rounds``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(int(gib * 2**30) // 4)
        x.sum()  # pages touched
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - start)
        return x.numel() * 4 / statistics.median(times)
    finally:
        torch.set_num_threads(before)


def weight_bytes(model_dir: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


def mbu(weights: int, tpot_ms: float, bandwidth: float) -> float:
    return weights / (tpot_ms / 1e3) / bandwidth
