"""The CPU quantized linear kernel (``cpu_qlinear.c``): built at first use, loaded by ctypes.

Built like the decode attention kernel (engine/native_build.py). No compiler, a failed build
or an unwritable cache directory: ``load_kernel()`` is None and ``QuantLinear`` dequantizes
and multiplies through torch (logged once at INFO).

    run(x [T, K] float32, w: QuantWeight, bias [N] float32 | None, out [T, N] float32)

Rows of ``x`` and ``out`` may be strided (last dimension contiguous). The arithmetic of each
output element is fixed (the C file's docstring), whatever T and the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pdserve.engine import native_build
from pdserve.engine.native_build import find_compiler
from pdserve.engine.quant.weights import QuantKind, QuantWeight
from pdserve.envs import pdserve_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_qlinear.c")
SYMBOL = "pdserve_qlinear"
KINDS: dict[QuantKind, int] = {"i8": 0, "u4": 1}
# Below this many weights x rows (N * K * T) one thread does the layer: waking a second one
# costs more than it saves.
PARALLEL_MIN_WORK = 1 << 18


class QLinearKernel:
    """``run`` writes ``x W^T (+ bias)`` into ``out``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = getattr(lib, SYMBOL)
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [p, i64, i64, i64, p, p, p, i64, i32, p, p, i64, i64, i32]
        fn.restype = i32
        self._fn = fn

    def run(
        self,
        x: torch.Tensor,  # [T, K] float32
        w: QuantWeight,
        bias: torch.Tensor | None,  # [N] float32, contiguous
        out: torch.Tensor,  # [T, N] float32, rows contiguous
        threads: int | None = None,  # None: torch's; 1 below PARALLEL_MIN_WORK either way
    ) -> None:
        n, k = w.shape
        t = x.shape[0]
        threads = threads or torch.get_num_threads()
        if n * k * t < PARALLEL_MIN_WORK:
            threads = 1
        status = self._fn(
            x.data_ptr(),
            x.stride(0),
            t,
            k,
            w.data.data_ptr(),
            w.scales.data_ptr(),
            None if w.mins is None else w.mins.data_ptr(),
            w.group,
            KINDS[w.kind],
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            n,
            threads,
        )
        if status != 0:
            raise MemoryError(f"quantized linear kernel: no memory for its buffers ({n}x{k})")


@functools.cache
def load_kernel() -> QLinearKernel | None:
    """The kernel, built on first use in this process; None (logged once) when it cannot be."""
    lib = native_build.open_library(
        SOURCE,
        find_compiler(),
        pdserve_home() / "kernels",
        logger,
        "quantized linear layers (dequantize + matmul)",
    )
    return None if lib is None else QLinearKernel(lib)


def build(compiler: str, cache_dir: Path | None = None) -> Path:
    """The kernel's shared library, compiled unless a matching one is cached."""
    return native_build.build(SOURCE, compiler, cache_dir or pdserve_home() / "kernels")
