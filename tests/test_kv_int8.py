"""The int8 KV cache's rows (engine/attention/kv_quant.py): the quantization round trip, writes
that do not depend on the batch, and every attention path over one int8 cache: the C decode
kernel reading it in place against the torch paths that dequantize what they gather, and both
against float64 attention over the dequantized values."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import TorchAttentionBackend
from pdserve.engine.attention.kv_quant import dequantize_rows, head_dim_of, quantize_rows
from pdserve.engine.attention.torch_ops import KVSlots, write_kv_slots
from tests.test_cpu_attention_kernel import kernel, make_step, needs_kernel, run, spy_on_kernel

__all__ = ["kernel"]  # the fixture ``needs_kernel`` uses

CPU = torch.device("cpu")


def int8_step(query_lens, seq_lens, heads, kv_heads, dim, bs, dtype=torch.float32, seed=0):
    """``make_step`` with its random cache quantized (q, k, v in ``dtype``)."""
    meta, cache, qkv = make_step(query_lens, seq_lens, heads, kv_heads, dim, bs, dtype, seed)
    return meta, quantize_rows(cache.float()), qkv


def reference(meta, cache, qkv) -> torch.Tensor:
    """float64 attention of each sequence's last query row over the dequantized cache."""
    values = dequantize_rows(cache).double()  # [blocks, 2, bs, KV, D]
    q = qkv[0].double()
    out, start = [], 0
    for q_len, seq_len, table in zip(
        meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables_cpu, strict=True
    ):
        k = values[table, 0].flatten(0, 1)[:seq_len]  # [L, KV, D]
        v = values[table, 1].flatten(0, 1)[:seq_len]
        qi = q[start + q_len - 1]  # [H, D]
        group = qi.shape[0] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,lhd->hl", qi, k) * q.shape[2] ** -0.5).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
        start += q_len
    return torch.stack(out)


# ---- rows ------------------------------------------------------------------------------------


def test_round_trip_within_half_a_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 3, 64, generator=g) * torch.logspace(-6, 4, 300).view(-1, 1, 1)
    x[7, 1] = 0.0  # an all-zero row
    x[8, 2, 5] = 1e4  # one outlier: the rest of its row gets coarse steps
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (300, 3, 68)
    assert head_dim_of(rows) == 64
    q = rows[..., :64].float()
    scale = rows[..., 64:].contiguous().view(torch.float32)  # [300, 3, 1]
    assert q.abs().max() <= 127
    assert torch.equal(scale, (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1.1754944e-38))
    err = (x - dequantize_rows(rows)).abs()
    assert (err <= scale / 2 * (1 + 2**-20)).all()  # half a step, plus float32 rounding
    assert torch.equal(dequantize_rows(rows)[7, 1], torch.zeros(64))
    # every row's largest value is exact up to rounding: it maps to +-127
    assert (q.abs().amax(-1) == 127).sum() == 300 * 3 - 1


def test_a_rows_bytes_do_not_depend_on_its_batch() -> None:
    """Written all at once (a prompt) or a token at a time (decode): the same bytes."""
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 10, 2, 16, generator=g)
    whole, single = (torch.zeros(4, 2, 4, 2, 20, dtype=torch.int8) for _ in range(2))
    slots = torch.tensor([5, 6, 7, 8, 9, 12, 13, 14, 15, 0])
    write_kv_slots(whole, KVSlots.from_slots(slots, 4), k, v)
    for i in range(10):
        write_kv_slots(single, KVSlots.from_slots(slots[i : i + 1], 4), k[i : i + 1], v[i : i + 1])
    assert torch.equal(whole, single)
    assert not whole[0, :, 1:4].any() and not whole[2, :, 2:].any()  # slots not written


# ---- attention over an int8 cache ---------------------------------------------------------------

ODD = [1, 3, 17, 63, 130, 1031]  # within a block, past blocks and a 128-token chunk


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (6, 1)])
@pytest.mark.parametrize("dim", [16, 48, 64, 128])  # 64 and 128 have their own unrolled loops
@pytest.mark.parametrize("bs", [1, 4, 32])
def test_kernel_reads_int8_in_place_as_torch_dequantizes(
    heads, kv_heads, dim, bs, monkeypatch
) -> None:
    """Bound: 1e-5 between the paths (|out| ~ 1; float32 sums in two orders, the scale applied
    to the sum or to each value), 5e-6 from float64 attention over the same int8 values."""
    meta, cache, qkv = int8_step([1] * len(ODD), ODD, heads, kv_heads, dim, bs)
    backend = TorchAttentionBackend(CPU)
    calls = spy_on_kernel(backend, monkeypatch)
    got, got_cache = run(backend, meta, cache, qkv)
    assert calls == [len(ODD)]
    want, want_cache = run(TorchAttentionBackend(CPU, cpu_kernel=False), meta, cache, qkv)
    assert torch.equal(got_cache, want_cache)  # the same quantized writes
    assert (got - want).abs().max().item() <= 1e-5
    assert (got.double() - reference(meta, got_cache, qkv)).abs().max().item() <= 5e-6


@needs_kernel
def test_mixed_step_over_int8_prefill_through_sdpa(monkeypatch) -> None:
    """Prompt chunks (SDPA over dequantized gathered blocks) beside decode rows (kernel)."""
    q_lens, s_lens = [1, 7, 1, 40, 1], [33, 7, 1, 100, 1000]
    meta, cache, qkv = int8_step(q_lens, s_lens, 9, 3, 64, 16)
    backend = TorchAttentionBackend(CPU)
    calls = spy_on_kernel(backend, monkeypatch)
    got, written = run(backend, meta, cache, qkv)
    assert calls == [3]
    want, _ = run(TorchAttentionBackend(CPU, cpu_kernel=False), meta, cache, qkv)
    decode = [0, 8, 49]  # q rows of the single-token sequences
    prefill = [i for i in range(got.shape[0]) if i not in decode]
    assert torch.equal(got[prefill], want[prefill])
    assert (got[decode] - want[decode]).abs().max().item() <= 1e-5
    last_rows = [0, 7, 8, 48, 49]  # each sequence's last query row, prompts included
    assert (got[last_rows].double() - reference(meta, written, qkv)).abs().max() <= 5e-6


@needs_kernel
def test_bf16_queries_over_int8_rounded_once(monkeypatch) -> None:
    meta, cache, qkv = int8_step([1] * len(ODD), ODD, 9, 3, 64, 16, dtype=torch.bfloat16)
    backend = TorchAttentionBackend(CPU)
    calls = spy_on_kernel(backend, monkeypatch)
    got, written = run(backend, meta, cache, qkv)
    assert calls == [len(ODD)] and got.dtype == torch.bfloat16
    exact = reference(meta, written, qkv)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()  # half a bf16 ulp
    want, _ = run(TorchAttentionBackend(CPU, cpu_kernel=False), meta, cache, qkv)
    assert (want.double() - exact).abs().max() <= 0.05  # torch: K/V rounded to bf16 as well


def test_torch_path_is_the_float_path_over_dequantized_values() -> None:
    """With no kernel, the int8 cache gives what a float32 cache holding its dequantized
    values gives (the same ops after the gather), to float32 rounding."""
    meta, cache, qkv = int8_step([1, 5, 1], [40, 5, 9], 8, 2, 32, 4)
    backend = TorchAttentionBackend(CPU, cpu_kernel=False)
    got, written = run(backend, meta, cache, qkv)
    q, k, v = qkv
    rounded = (q, dequantize_rows(quantize_rows(k)), dequantize_rows(quantize_rows(v)))
    as_float, float_written = run(backend, meta, dequantize_rows(cache), rounded)
    assert torch.equal(float_written, dequantize_rows(written))
    assert (got - as_float).abs().max().item() <= 1e-6
