"""A CPU stand-in for the slice of flashinfer's API that FlashInferBackend uses (0.5–0.7
signatures), computing attention from nothing but the page lists it is planned with, so the
backend's own code (planning, wrapper choice, K/V writes, CUDA-graph padding) runs on CPU.

It checks what it is given the way flashinfer documents it: int32 index lists, CSR shapes,
``NHD`` layout, a batch size fixed at construction in CUDA-graph mode.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from pdserve.engine.attention.flashinfer_backend import PagedIndices


def attention_from_page_lists(
    q: torch.Tensor, kv_cache: torch.Tensor, idx: PagedIndices, scale: float, causal: bool = True
) -> torch.Tensor:
    """Paged attention as flashinfer defines it: causal with queries at the end of their
    context; ``kv_cache`` is [pages, 2, page_size, KV, D] (NHD, K and V together)."""
    out = torch.empty_like(q)
    heads, kv_heads, page = q.shape[1], kv_cache.shape[3], kv_cache.shape[2]
    for i in range(len(idx.qo_indptr) - 1):
        pages = idx.kv_indices[idx.kv_indptr[i] : idx.kv_indptr[i + 1]]
        length = (len(pages) - 1) * page + idx.last_page_len[i]
        kv = kv_cache[pages].transpose(0, 1).reshape(2, -1, kv_heads, kv_cache.shape[-1])
        k, v = (x[:length].repeat_interleave(heads // kv_heads, dim=1) for x in kv)
        a, b = idx.qo_indptr[i], idx.qo_indptr[i + 1]
        scores = torch.einsum("qhd,khd->hqk", q[a:b].to(k.dtype), k) * scale
        if causal:
            q_pos = torch.arange(length - (b - a), length)[:, None]
            scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v).to(q.dtype)
    return out


def _ints(t: torch.Tensor, what: str) -> list[int]:
    assert t.dtype == torch.int32, f"{what} must be int32, got {t.dtype}"
    return t.tolist()


class _Wrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kw) -> None:
        assert kv_layout == "NHD"
        self.kw = kw
        self.plans: list[dict] = []
        self.runs = 0
        self.idx: PagedIndices | None = None
        self.fixed_batch = None
        if kw.get("use_cuda_graph"):
            self.fixed_batch = kw["paged_kv_last_page_len_buffer"].shape[0]

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert self.idx is not None, "run() before plan()"
        assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2
        plan = self.plans[-1]
        assert q.shape[0] == self.idx.qo_indptr[-1] and q.shape[1:] == (
            plan["num_qo_heads"], plan["head_dim"],
        )  # fmt: skip
        self.runs += 1
        return attention_from_page_lists(q, kv_cache, self.idx, plan["sm_scale"], plan["causal"])


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(
        self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
        num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None,
        pos_encoding_mode="NONE", q_data_type="float16", kv_data_type=None, non_blocking=False,
    ) -> None:  # fmt: skip
        self.idx = PagedIndices(
            _ints(qo_indptr, "qo_indptr"),
            _ints(paged_kv_indptr, "paged_kv_indptr"),
            _ints(paged_kv_indices, "paged_kv_indices"),
            _ints(paged_kv_last_page_len, "paged_kv_last_page_len"),
        )
        self.plans.append(
            dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim_qk,
                 page_size=page_size, causal=causal, sm_scale=sm_scale, q_data_type=q_data_type)
        )  # fmt: skip


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(
        self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
        pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
        kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
        non_blocking=False,
    ) -> None:  # fmt: skip
        batch = len(last_page_len)
        if self.fixed_batch is not None:
            assert batch == self.fixed_batch, "CUDA-graph wrappers keep their batch size"
            assert len(indices) <= self.kw["paged_kv_indices_buffer"].shape[0]
        self.idx = PagedIndices(
            list(range(batch + 1)),
            _ints(indptr, "indptr"),
            _ints(indices, "indices"),
            _ints(last_page_len, "last_page_len"),
        )
        self.plans.append(
            dict(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 page_size=page_size, causal=False, sm_scale=sm_scale, q_data_type=q_data_type)
        )  # fmt: skip


def fake_flashinfer() -> types.ModuleType:
    """A module to put in ``sys.modules["flashinfer"]``; it records the wrappers it makes."""
    mod = types.ModuleType("flashinfer")
    mod.__version__ = "0.6.0-fake"
    made: list[_Wrapper] = []

    def recorded(cls):
        def make(*args, **kwargs):
            made.append(cls(*args, **kwargs))
            return made[-1]

        return make

    mod.BatchPrefillWithPagedKVCacheWrapper = recorded(BatchPrefillWithPagedKVCacheWrapper)
    mod.BatchDecodeWithPagedKVCacheWrapper = recorded(BatchDecodeWithPagedKVCacheWrapper)
    mod.made = made
    return mod
