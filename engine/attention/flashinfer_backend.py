"""Attention over the paged cache with flashinfer's batch wrappers (CUDA, bf16/fp16).

Written against flashinfer 0.5–0.7 (``plan`` with keyword options, ``run(q, kv_cache)``), and
NOT yet run on a GPU: ``bench/micro/gpu.py`` checks it against the torch backend on hardware.

The cache is already flashinfer's ``NHD`` layout with K and V together, so it is passed as is.
Per step, ``plan`` turns the host block tables into flashinfer's CSR page lists::

    qo_indptr      [B + 1]  query rows of sequence i: qo_indptr[i]:qo_indptr[i + 1]
    kv_indptr      [B + 1]  pages of sequence i: kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
    kv_indices     [sum pages]
    last_page_len  [B]      tokens used in each sequence's last page, 1..block_size

The wrapper itself is planned at the first layer's ``forward`` (only then are heads, head
size, dtype and scale known) and reused by every later layer of the step. A step of decode
rows only goes to the decode wrapper; anything else (prefill chunks, prefix-cache hits and
decode rows together) to the prefill wrapper, causal, queries aligned to the end of their
context. float32 models and head sizes flashinfer does not build fall back to the torch
backend. CUDA graphs use ``graph_state`` / ``plan_graph`` (see ``engine/cuda_graphs.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata, write_kv
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.protocol.blocks import blocks_for

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 * 2**20
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_HEAD_DIMS = (64, 128, 256)

# what a wrapper is planned for: num_heads, num_kv_heads, head_dim, q dtype, kv dtype, scale
PlanKey = tuple[int, int, int, torch.dtype, torch.dtype, float]
# a CUDA-graph decode step: num_heads, num_kv_heads, head_dim, dtype (q and kv), scale
GraphShape = tuple[int, int, int, torch.dtype, float]


@dataclass(frozen=True)
class PagedIndices:
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    last_page_len: list[int]


def paged_kv_indices_from(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> PagedIndices:
    """flashinfer's page lists for a ragged batch (pure Python, no device)."""
    qo, kv, indices, last = [0], [0], [], []
    for q_len, seq_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        if not 1 <= q_len <= seq_len:
            raise ValueError(f"query length {q_len} outside [1, context {seq_len}]")
        pages = blocks_for(seq_len, block_size)
        if pages > len(table):
            raise ValueError(
                f"context of {seq_len} tokens needs {pages} blocks, table has {len(table)}"
            )
        qo.append(qo[-1] + q_len)
        indices.extend(table[:pages])
        kv.append(len(indices))
        last.append(seq_len - (pages - 1) * block_size)
    return PagedIndices(qo, kv, indices, last)


def paged_kv_indices(metadata: AttentionMetadata) -> PagedIndices:
    return paged_kv_indices_from(
        metadata.query_lens_cpu,
        metadata.seq_lens_cpu,
        metadata.block_tables_cpu,
        metadata.block_size,
    )


def write_kv_masked(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    valid: torch.Tensor,  # [T] bool: False = padding row, its slot keeps its old value
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """``write_kv`` for padded (CUDA-graph) batches: padding rows point at a slot no real row
    writes this step and write back what it holds, so the cache is unchanged there."""
    bs = kv_cache.shape[2]
    blocks, rows = slot_mapping // bs, slot_mapping % bs
    keep = valid[:, None, None]
    kv_cache[blocks, 0, rows] = torch.where(keep, k.to(kv_cache.dtype), kv_cache[blocks, 0, rows])
    kv_cache[blocks, 1, rows] = torch.where(keep, v.to(kv_cache.dtype), kv_cache[blocks, 1, rows])


@dataclass
class GraphState:
    """One batch-size bucket: a CUDA-graph decode wrapper over fixed index buffers, and the
    static slot/valid inputs the captured ``forward`` reads."""

    batch_size: int
    wrapper: Any  # a flashinfer BatchDecodeWithPagedKVCacheWrapper (flashinfer has no types)
    slot_mapping: torch.Tensor  # [batch_size] int64, static
    valid: torch.Tensor  # [batch_size] bool, static


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(self, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        import flashinfer  # checked usable by make_backend; imported here, not at module load

        self._fi = flashinfer
        self.device = device
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        # flashinfer's decode wrapper (untyped, Any), made at first use: tensor cores or not
        # depends on the GQA group
        self._decode: Any = None
        self._fallback = TorchAttentionBackend(device)
        self._meta: AttentionMetadata | None = None
        self._indices: PagedIndices | None = None
        # what this step's wrapper was planned for ("torch": the fallback backend)
        self._planned: PlanKey | Literal["torch"] | None = None
        self._graph: GraphState | None = None
        self._decode_step = False  # every row of this step is one decode token
        self._warned: set[PlanKey] = set()

    # ---- eager steps -------------------------------------------------------------------------
    def plan(self, metadata: AttentionMetadata) -> None:
        self._meta = metadata
        self._indices = paged_kv_indices(metadata)
        self._decode_step = all(n == 1 for n in metadata.query_lens_cpu)
        self._planned = None
        self._graph = None

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KV, D]
        scale: float,
    ) -> torch.Tensor:
        if self._graph is not None:
            g = self._graph
            write_kv_masked(kv_cache, g.slot_mapping, g.valid, k, v)
            graph_out: torch.Tensor = g.wrapper.run(q, kv_cache)  # [T, H, D]
            return graph_out
        if self._meta is None or self._indices is None:
            raise RuntimeError("plan() must run before forward()")
        key = (q.shape[1], kv_cache.shape[3], q.shape[2], q.dtype, kv_cache.dtype, scale)
        if not self.kernel_supports(q.dtype, q.shape[2]):
            return self._fallback_forward(key, self._meta, q, k, v, kv_cache, scale)
        if self._planned != key:
            self._plan_wrapper(key, kv_cache.shape[2])
        write_kv(kv_cache, self._meta.slot_mapping, k, v)
        wrapper = self._decode if self._decode_step else self._prefill
        out: torch.Tensor = wrapper.run(q, kv_cache)  # [T, H, D]
        return out

    @staticmethod
    def kernel_supports(dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in KERNEL_DTYPES and head_dim in KERNEL_HEAD_DIMS

    def _plan_wrapper(self, key: PlanKey, block_size: int) -> None:
        num_heads, num_kv_heads, head_dim, q_dtype, kv_dtype, scale = key
        idx = self._indices
        assert idx is not None
        qo, kv, last = (_host_i32(x) for x in (idx.qo_indptr, idx.kv_indptr, idx.last_page_len))
        pages = _host_i32(idx.kv_indices).to(self.device, non_blocking=True)  # the one H2D copy
        common = {
            "q_data_type": q_dtype,
            "kv_data_type": kv_dtype,
            "sm_scale": scale,
            "non_blocking": True,  # pinned host lists: no host sync in plan
        }
        if self._decode_step:
            self._decode_wrapper(num_heads // num_kv_heads).plan(
                kv,
                pages,
                last,
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                pos_encoding_mode="NONE",
                **common,
            )
        else:
            self._prefill.plan(
                qo,
                kv,
                pages,
                last,
                num_heads,
                num_kv_heads,
                head_dim,
                block_size,
                causal=True,
                pos_encoding_mode="NONE",
                **common,
            )
        self._planned = key

    def _decode_wrapper(self, group: int) -> Any:  # flashinfer's wrapper: untyped
        if self._decode is None:
            self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=group >= 4
            )
        return self._decode

    def _fallback_forward(
        self,
        key: PlanKey,
        metadata: AttentionMetadata,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(
                "flashinfer kernels cover %s with head size %s; %s / %d go to the torch backend",
                "/".join(str(d).removeprefix("torch.") for d in KERNEL_DTYPES),
                "/".join(map(str, KERNEL_HEAD_DIMS)),
                q.dtype,
                q.shape[2],
            )
        if self._planned != "torch":
            self._fallback.plan(metadata)
            self._planned = "torch"
        return self._fallback.forward(q, k, v, kv_cache, scale)

    # ---- CUDA graphs (decode only) -----------------------------------------------------------
    def graph_state(self, batch_size: int, max_pages: int, group: int) -> GraphState:
        """A decode wrapper for exactly ``batch_size`` rows whose index buffers stay put, so a
        captured graph can replay after each ``plan_graph``."""
        dev = self.device
        wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=group >= 4,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=dev),
            paged_kv_last_page_len_buffer=torch.ones(batch_size, dtype=torch.int32, device=dev),
        )
        slots = torch.zeros(batch_size, dtype=torch.long, device=dev)
        valid = torch.zeros(batch_size, dtype=torch.bool, device=dev)
        return GraphState(batch_size, wrapper, slots, valid)

    def plan_graph(
        self, state: GraphState, indices: PagedIndices, shape: GraphShape, block_size: int
    ) -> None:
        """Plan ``state``'s wrapper (outside the graph) and route ``forward`` to it.

        ``shape``: (num_heads, num_kv_heads, head_dim, dtype, scale)."""
        num_heads, num_kv_heads, head_dim, dtype, scale = shape
        state.wrapper.plan(
            _host_i32(indices.kv_indptr),
            _host_i32(indices.kv_indices),
            _host_i32(indices.last_page_len),
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            pos_encoding_mode="NONE",
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=scale,
            non_blocking=True,
        )
        self._graph = state
        self._meta = None


def _host_i32(values: list[int]) -> torch.Tensor:
    """A pinned int32 host tensor: flashinfer copies it to the device without a host sync."""
    t = torch.tensor(values, dtype=torch.int32)
    return t.pin_memory() if torch.cuda.is_available() else t
