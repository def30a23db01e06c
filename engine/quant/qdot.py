"""Integer dot products for quantized linear layers on the CPU (``cpu_qdot.c``).

    --quant-activations int16    activations quantized per 32 values to int16 (d = max|x| /
                                 32767), integer dot products with the weights' codes
    --quant-activations int8     the same in int8 (llama.cpp's Q8_0): twice the arithmetic
                                 rate, 256 times the rounding
    --quant-activations float32  the weights dequantized to float32 in registers, float
                                 activations (cpu_qlinear.c): exact to the weights

``pack`` repacks a ``QuantWeight`` once, at load, into the kernel's layout (the C file's
header draws it); ``QDotKernel.run`` computes ``x W^T (+ bias)``. The instruction path is
picked once a process, the best this CPU and its OS grant (``PATHS``, best first), and named in
the log and the model line of ``pdserve models``/metrics. Every path gives the same bits, and a
row's result does not depend on the batch, so workers on different hosts agree token for token.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine import native_build
from pdserve.engine.native_build import find_compiler
from pdserve.engine.quant.weights import BLOCK, QuantWeight, unpack_nibbles
from pdserve.envs import pdserve_home

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_qdot.c")
ROWS = 16  # weight rows a group interleaves
PATHS = ("c", "avx2", "avx-vnni", "avx512-vnni")  # the C file's PATH_* order: worst to best
PATH_ENV = "PDSERVE_QDOT_PATH"  # tests: force a path the host has (e.g. avx2 on a VNNI host)


@dataclass(frozen=True)
class PackedWeight:
    """A ``QuantWeight`` in the kernel's layout; ``n`` and ``k`` the unpadded shape."""

    kind: str  # "i8" | "u4"
    codes: torch.Tensor  # i8: int8 [G, NB, 8, 64]; u4: uint8 [G, NB, 4, 64]
    scales: torch.Tensor  # float16 [G, NB, 16]
    mins: torch.Tensor | None  # float16 [G, NB, 16] (u4)
    n: int
    k: int
    name: str

    @property
    def nbytes(self) -> int:
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.codes.nbytes + self.scales.nbytes + extra


def pack(w: QuantWeight) -> PackedWeight:
    """``w`` repacked: 16 rows interleaved 4 codes at a time, per-group scales (and mins)
    repeated for each of their 32-weight blocks, rows padded to 16 with zeros."""
    n, k = w.shape
    groups, nb = -(-n // ROWS), k // BLOCK
    pad = groups * ROWS - n
    codes = unpack_nibbles(w.data) if w.kind == "u4" else w.data  # [N, K]
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    # [G, 16 rows, NB, 8 chunks, 4] -> [G, NB, 8 chunks, 16 rows, 4]
    chunks = codes.reshape(groups, ROWS, nb, 8, 4).permute(0, 2, 3, 1, 4)
    if w.kind == "u4":
        chunks = chunks[:, :, :4] | (chunks[:, :, 4:] << 4)  # chunk p low, chunk p + 4 high
    blocks_per_group = w.group // BLOCK

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, K // group] -> [G, NB, 16]
        t = t.repeat_interleave(blocks_per_group, dim=1)
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.reshape(groups, ROWS, nb).permute(0, 2, 1).contiguous()

    return PackedWeight(
        kind=w.kind,
        codes=chunks.reshape(groups, nb, -1, 64).contiguous(),
        scales=per_block(w.scales),
        mins=None if w.mins is None else per_block(w.mins),
        n=n,
        k=k,
        name=w.name,
    )


class QDotLayer:
    """One layer's weight, bias and path held by the kernel (the C side's ``layer``):
    ``run(x, out, threads)`` on contiguous float32 rows, 5 arguments a call instead of 13
    (a serving step makes ~4 calls a layer: the conversion of arguments showed in its time)."""

    def __init__(
        self, kernel: QDotKernel, w: PackedWeight, bias: torch.Tensor | None, bits: int
    ) -> None:
        path = PATHS.index(kernel.path)
        handle = kernel.lib.pdserve_qdot_layer(
            w.k,
            w.n,
            w.codes.data_ptr(),
            w.scales.data_ptr(),
            None if w.mins is None else w.mins.data_ptr(),
            None if bias is None else bias.data_ptr(),
            path,
            bits,
        )
        if not handle:
            raise MemoryError("quantized dot-product kernel: no memory for a layer")
        self._call = kernel.lib.pdserve_qdot_call
        self._tensors = (w, bias)  # what the handle points into, alive as long as it
        self._free = weakref.finalize(self, kernel.lib.pdserve_qdot_free, handle)
        self._handle = handle
        self.address: int = handle  # the C side's layer (engine/cpu_layers.c calls it)
        self.kernel, self.bits = kernel, bits

    def run(self, x: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """x [T, K] and out [T, N] float32, contiguous; ``threads`` at most (one for a small
        layer: the kernel's own rule)."""
        t = x.shape[0]
        if self._call(self._handle, x.data_ptr(), t, out.data_ptr(), threads):
            raise MemoryError(f"quantized dot-product kernel: no memory for {t} activation rows")


class QDotKernel:
    """``run`` writes ``x W^T (+ bias)`` into ``out`` through ``path``; ``layer`` holds a
    layer's constants for repeated calls."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.pdserve_qdot
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [p, i64, i64, i64, p, p, p, p, p, i64, i64, i32, i32, i32]
        fn.restype = i32
        self._fn = fn
        lib.pdserve_qdot_layer.argtypes = [i64, i64, p, p, p, p, i32, i32]
        lib.pdserve_qdot_layer.restype = p
        lib.pdserve_qdot_call.argtypes = [p, p, i64, p, i32]
        lib.pdserve_qdot_call.restype = i32
        lib.pdserve_qdot_free.argtypes = [p]
        lib.pdserve_qdot_free.restype = None
        self.lib = lib
        lib.pdserve_qdot_paths.restype = i32
        granted = lib.pdserve_qdot_paths()
        self.paths = tuple(name for i, name in enumerate(PATHS) if granted >> i & 1)
        self.path = _chosen(self.paths)

    def layer(self, w: PackedWeight, bias: torch.Tensor | None, bits: int = 8) -> QDotLayer:
        return QDotLayer(self, w, bias, bits)

    def run(
        self,
        x: torch.Tensor,  # [T, K] float32, rows contiguous
        w: PackedWeight,
        bias: torch.Tensor | None,  # [N] float32
        out: torch.Tensor,  # [T, N] float32, rows contiguous
        threads: int | None = None,  # None: torch's; one for a small layer (the C's rule)
        path: str | None = None,  # None: ``self.path``
        bits: int = 8,  # the activations': 8 or 16
    ) -> None:
        t = x.shape[0]
        threads = threads or torch.get_num_threads()
        status = self._fn(
            x.data_ptr(),
            x.stride(0),
            t,
            w.k,
            w.codes.data_ptr(),
            w.scales.data_ptr(),
            None if w.mins is None else w.mins.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            w.n,
            threads,
            PATHS.index(path or self.path),
            bits,
        )
        if status == -2:
            raise ValueError(f"quantized dot-product path {path!r} is not available here")
        if status != 0:
            raise MemoryError(f"quantized dot-product kernel: no memory for {t}x{w.k} activations")


def _chosen(paths: tuple[str, ...]) -> str:
    forced = os.environ.get(PATH_ENV)
    if forced:
        if forced not in paths:
            raise ValueError(f"{PATH_ENV}={forced}: this CPU offers {', '.join(paths)}")
        return forced
    return paths[-1]


@functools.cache
def load_kernel() -> QDotKernel | None:
    """The kernel, built on first use in this process; None (logged once) when it cannot be."""
    lib = native_build.open_library(
        SOURCE,
        find_compiler(),
        pdserve_home() / "kernels",
        logger,
        "quantized linear layers by integer dot products",
    )
    if lib is None:
        return None
    kernel = QDotKernel(lib)
    logger.info("int8 activations: integer dot products through %s", kernel.path)
    return kernel
