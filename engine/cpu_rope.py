"""Rotary embedding of a layer's query and key heads in one C call on CPU float32, in place in
the QKV projection's output (cpu_rope.c).

torch ran it as mul, roll (narrow, narrow, cat) and addcmul, a new [T, H + KV, D] tensor from
each: ~4.3 us a layer at batch 1 on this project's CPUs, mostly dispatch; this path is ~3.2 us
(~2 of them the ctypes call), ~3.7 against ~5.9 at batch 8 (bench/micro/decode_ops.py).

Results equal torch's bit for bit: at first use the kernel is run against torch on a random
input, with and without the fma that torch's addcmul may have been built with; if neither
matches exactly, rope stays with torch on this machine, said once in the log. Anything the
kernel does not take (not float32, not CPU, other strides, traced by torch.compile, no
compiler) runs through torch too.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.native_build import FLAGS, find_compiler, open_library
from pdserve.envs import pdserve_home

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_rope.c")
# the one fma in the C is written as one (torch's rounding); the compiler contracts nothing else
BUILD_FLAGS = (*FLAGS, "-ffp-contract=off")


@dataclass(frozen=True)
class RopeKernel:
    fn: CFuncPtr
    fma: bool  # whether torch's addcmul rounds once (an fma), as the kernel then does


@functools.cache
def kernel() -> RopeKernel | None:
    """The C function, checked against torch once; None: no library, or no exact match."""
    cache = pdserve_home() / "kernels"
    lib = open_library(SOURCE, find_compiler(), cache, logger, "rope", BUILD_FLAGS)
    if lib is None:
        return None
    fn = lib.pdserve_rope
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, i64, i64, i64, i64, p, p, i32, i32]
    fn.restype = None
    fma = next((f for f in (True, False) if _matches_torch(fn, f)), None)
    if fma is None:
        logger.info("rope C kernel differs from torch on this machine: rope through torch")
        return None
    return RopeKernel(fn, fma)


def _matches_torch(fn: CFuncPtr, fma: bool) -> bool:
    """Heads of 48: ATen's vector loop, then its scalar one (either may have been built with
    the fma)."""
    g = torch.Generator().manual_seed(0)
    x, cos, sin = (
        torch.randn(rows, heads, 48, generator=g) for rows, heads in ((3, 5), (3, 1), (3, 1))
    )
    expected = torch.addcmul(x * cos, x.roll(24, dims=-1), sin)
    _run(RopeKernel(fn, fma), x, cos, sin)
    return torch.equal(x, expected)


def _run(k: RopeKernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    rows, heads, dim = x.shape
    k.fn(x.data_ptr(), rows, x.stride(0), heads, dim, cos.data_ptr(), sin.data_ptr(), int(k.fma),
         torch.get_num_threads())  # fmt: skip


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> bool:
    """``x = x * cos + roll(x, D / 2) * sin_signed`` in place, as ``rope.apply_rotary``
    computes it; False (x untouched) where the kernel does not take these tensors.

    x: [T, heads, D], heads D apart (rows any distance: a view of the QKV projection);
    cos, sin_signed: [T, 1, D] contiguous. (Checks with the cheapest tensor attributes: this
    runs once a layer, and the call is ~2 us.)"""
    if torch.compiler.is_compiling():  # first: dynamo must not trace into kernel()
        return False
    k = kernel()
    if k is None or x.dim() != 3:
        return False
    rows, heads, dim = x.shape
    row_stride, head_stride, elem_stride = x.stride()
    if not (
        x.dtype == cos.dtype == sin_signed.dtype == torch.float32
        and x.is_cpu
        and cos.is_cpu
        and sin_signed.is_cpu
        and dim % 2 == 0
        and elem_stride == 1
        and (heads == 1 or head_stride == dim)
        and (rows == 1 or row_stride >= heads * dim)  # rows that do not overlap
        and cos.shape == sin_signed.shape == (rows, 1, dim)
        and cos.is_contiguous()
        and sin_signed.is_contiguous()
    ):
        return False
    _run(k, x, cos, sin_signed)
    return True
