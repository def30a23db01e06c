"""flashinfer's page lists from a step's metadata, by exact value, and checked by meaning:
attention computed from nothing but those lists (causal, queries at the end of their context,
as flashinfer's wrappers define it) equals the torch backend on a mixed ragged batch."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.engine.attention.flashinfer_backend import (
    FlashInferBackend,
    PagedIndices,
    paged_kv_indices,
    paged_kv_indices_from,
)
from tests.flashinfer_fake import attention_from_page_lists

BS = 4


def metadata(query_lens: list[int], seq_lens: list[int], tables: list[list[int]]):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    slots = [
        table[p // BS] * BS + p % BS
        for q, s, table in zip(query_lens, seq_lens, tables, strict=True)
        for p in range(s - q, s)
    ]
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=tables,
        block_size=BS,
    )


# a decode row (context 5), a chunk of 3 after a 6-token prefix hit, a whole 4-token prompt,
# a decode row at a block boundary (context 8); tables may be longer than the context needs
MIXED = metadata([1, 3, 4, 1], [5, 9, 4, 8], [[7, 2, 11], [0, 5, 9], [3], [4, 6]])


def test_page_lists_exact() -> None:
    assert paged_kv_indices(MIXED) == PagedIndices(
        qo_indptr=[0, 1, 4, 8, 9],
        kv_indptr=[0, 2, 5, 6, 8],
        kv_indices=[7, 2, 0, 5, 9, 3, 4, 6],
        last_page_len=[1, 1, 4, 4],
    )
    assert paged_kv_indices_from([1], [16], [[3, 1, 4, 1]], 16) == PagedIndices(
        [0, 1], [0, 1], [3], [16]
    )


def test_page_lists_reject_bad_rows() -> None:
    with pytest.raises(ValueError, match=r"query length 5 outside \[1, context 4\]"):
        paged_kv_indices_from([5], [4], [[0]], BS)
    with pytest.raises(ValueError, match=r"context of 9 tokens needs 3 blocks, table has 2"):
        paged_kv_indices_from([1], [9], [[0, 1]], BS)


def test_page_lists_mean_what_the_torch_backend_computes() -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    cache = torch.randn(12, 2, BS, kv_heads, dim, generator=g, dtype=torch.float64)
    tokens = MIXED.num_tokens
    q = torch.randn(tokens, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(tokens, kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(tokens, kv_heads, dim, generator=g, dtype=torch.float64)
    backend = TorchAttentionBackend(torch.device("cpu"))
    backend.plan(MIXED)
    expected = backend.forward(q, k, v, cache, dim**-0.5)  # also writes k/v into the cache
    got = attention_from_page_lists(q, cache, paged_kv_indices(MIXED), dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_kernel_coverage() -> None:
    assert FlashInferBackend.kernel_supports(torch.bfloat16, 128)
    assert FlashInferBackend.kernel_supports(torch.float16, 64)
    assert not FlashInferBackend.kernel_supports(torch.float32, 128)
    assert not FlashInferBackend.kernel_supports(torch.bfloat16, 16)
