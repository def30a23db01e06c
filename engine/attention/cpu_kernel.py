"""The CPU paged decode attention kernel (``cpu_decode.c``): built at first use, loaded by ctypes.

Built with the system C compiler into ``$PDSERVE_HOME/kernels/cpu_decode-<sha>.so``
(engine/native_build.py). No compiler, a failed build or an unwritable cache directory:
``load_kernel()`` is None and the torch backend keeps its gather + bmm path (logged once at
INFO).

It reads float32 and bfloat16 caches with queries of their dtype, and int8 caches (rows with
their scale, kv_quant.py) with float32 or bfloat16 queries, in place. ``KernelPlan`` is its
per-step input, built once in the backend's ``plan`` and shared by every layer::

    plan int32: rows[B] | lens[B] | indptr[B + 1] | pages[sum of blocks used]
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.engine import native_build
from pdserve.engine.attention.kv_quant import head_dim_of
from pdserve.engine.native_build import find_compiler
from pdserve.envs import pdserve_home
from pdserve.protocol.blocks import blocks_for

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.c")
SYMBOL = "pdserve_paged_decode"
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtype codes (q and out)
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # (the cache)
# Below this many K/V rows a layer (context tokens x KV heads, summed over sequences) one
# thread does the layer: waking a second one costs more than it saves (measured: ~1,000).
PARALLEL_MIN_ROWS = 1024


@dataclass(frozen=True)
class KernelPlan:
    """A step's decode rows for the kernel: one int32 tensor (layout in the module docstring)."""

    data: torch.Tensor
    num_seqs: int
    tokens: int  # context positions attended, summed over sequences

    @classmethod
    def build(
        cls, rows: list[int], lens: list[int], tables: list[list[int]], block_size: int
    ) -> KernelPlan:
        indptr, pages = [0], []
        for seq_len, table in zip(lens, tables, strict=True):
            pages.extend(table[: blocks_for(seq_len, block_size)])
            indptr.append(len(pages))
        # through numpy: 3x faster than torch.tensor on a list of ints
        data = torch.from_numpy(np.array(rows + lens + indptr + pages, dtype=np.int32))
        return cls(data, len(rows), sum(lens))


class CpuDecodeKernel:
    """``run`` attends every planned decode row of ``q`` into the same row of ``out``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = getattr(lib, SYMBOL)
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        f32 = ctypes.c_float
        fn.argtypes = [p, i64, p, p, i32, i32, i32, i32, i32, f32, p, i64, i32, i32, i32]
        fn.restype = None
        self._fn = fn

    @staticmethod
    def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """float32 or bfloat16 CPU queries over a cache of their dtype or int8, head size a
        multiple of 16, block size a power of two, the cache contiguous and each q row's heads
        contiguous."""
        block_size, head_dim = kv_cache.shape[2], head_dim_of(kv_cache)
        return (
            kv_cache.dtype in (q.dtype, torch.int8)
            and q.dtype in DTYPES
            and q.device.type == kv_cache.device.type == "cpu"
            and head_dim % 16 == 0
            and block_size & (block_size - 1) == 0
            and kv_cache.is_contiguous()
            and q.stride(2) == 1
            and q.stride(1) == head_dim
        )

    def run(
        self,
        q: torch.Tensor,  # [T, H, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KV, D] (int8: D + 4)
        plan: KernelPlan,
        scale: float,
        out: torch.Tensor,  # [T, H, D] contiguous, q's dtype
        threads: int | None = None,  # None: torch's, for steps of PARALLEL_MIN_ROWS or more
    ) -> None:
        _, _, block_size, kv_heads, _ = kv_cache.shape
        head_dim = head_dim_of(kv_cache)
        if threads is None:
            big = plan.tokens * kv_heads >= PARALLEL_MIN_ROWS
            threads = torch.get_num_threads() if big else 1
        self._fn(
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            plan.data.data_ptr(),
            plan.num_seqs,
            q.shape[1],
            kv_heads,
            head_dim,
            block_size,
            scale,
            out.data_ptr(),
            out.stride(0),
            DTYPES[q.dtype],
            KV_DTYPES[kv_cache.dtype],
            threads,
        )


@functools.cache
def load_kernel() -> CpuDecodeKernel | None:
    """The kernel, built on first use in this process; None (logged once) when it cannot be."""
    lib = native_build.open_library(
        SOURCE, find_compiler(), pdserve_home() / "kernels", logger, "CPU decode attention"
    )
    return None if lib is None else CpuDecodeKernel(lib)


def build(compiler: str, cache_dir: Path | None = None) -> Path:
    """The kernel's shared library, compiled unless a matching one is cached."""
    return native_build.build(SOURCE, compiler, cache_dir or pdserve_home() / "kernels")
