"""Batch-1 decode memory-bandwidth utilisation (MBU): weight bytes read per step over the step
time, against the read bandwidth this machine measures now.

A batch-1 decode step reads every weight once, so ``step_bytes / TPOT`` is the bandwidth a
server used; the floor of TPOT is ``step_bytes / read_bandwidth``. Quantized weights read
fewer bytes: ``step_bytes`` counts them in the form each server holds.
"""

from __future__ import annotations

import json
import statistics
import struct
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


# bytes a decode step reads per weight of a matrix: int8 one code + a float16 scale per row
# (about nothing), int4 half a byte + float16 scale and minimum per group of 32
MATRIX_BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.5 + 4 / 32}


def step_bytes(model_dir: str | Path, quantization: str, gguf: Path | None) -> int:
    """Bytes one batch-1 decode step reads: the GGUF file for ``gguf``; else the float
    safetensors, its matrices at ``quantization``'s size ("int8" | "int4"; anything else
    float). An untied embedding is only looked up, so it counts only as the tied head."""
    if quantization == "gguf" and gguf is not None:
        return gguf.stat().st_size
    total = 0.0
    for path in Path(model_dir).glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        header.pop("__metadata__", None)
        tied = "lm_head.weight" not in header
        for name, t in header.items():
            start, end = t["data_offsets"]
            if len(t["shape"]) != 2 or quantization not in MATRIX_BYTES_PER_WEIGHT:
                total += 0 if "embed_tokens" in name and not tied else end - start
            elif "embed_tokens" not in name or tied:
                total += t["shape"][0] * t["shape"][1] * MATRIX_BYTES_PER_WEIGHT[quantization]
    return int(total)


def mbu(weights: int, tpot_ms: float, bandwidth: float) -> float:
    return weights / (tpot_ms / 1e3) / bandwidth
