"""The integer dot-product kernel (engine/quant/cpu_qdot.c): int8 / int16 activations x
quantized weights.

- Against a plain float64 reference of its own formula (activations quantized per 32 values,
  integer sums, one scale per block) within float32 rounding, and against the float product
  x W^T within the activations' quantization error, on the real model's shapes and odd ones.
- Every instruction path this host grants gives the same bits (the plain C one included), so a
  host without VNNI (AVX2) agrees with one with it, token for token.
- A row's result does not depend on the batch (alone, among 2 to 32 others) or the threads.
- The path picked is the best this CPU offers, and a forced one must be offered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.quant import qdot
from pdserve.engine.quant.qdot import PATHS, QDotKernel, load_kernel, pack
from pdserve.engine.quant.weights import QuantWeight, dequantize, quantize_int4, quantize_int8

SHAPES = [(960, 576), (576, 1536), (37, 64), (130, 96)]  # SmolLM2's, and rows not a multiple of 16
BATCHES = [1, 2, 3, 5, 8, 33]


@pytest.fixture(scope="module")
def kernel() -> QDotKernel:
    k = load_kernel()
    if k is None:
        pytest.fail("the integer dot-product kernel did not build (a C compiler is needed)")
    return k


def weight(form: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if form == "int8":  # one scale per row (group = K)
        return quantize_int8(w)
    if form == "Q8_0":  # a scale per 32 weights
        q = quantize_int8(w)
        return QuantWeight("i8", q.data, q.scales.repeat(1, k // 32), None, 32, "Q8_0")
    return quantize_int4(w, 64 if form == "int4-g64" and k % 64 == 0 else 32)


def quantized_acts(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations: q int [T, K] and d [T, K // 32] (float32, as it rounds them)."""
    top = 127 if bits == 8 else 32767
    b = x.reshape(x.shape[0], -1, 32)
    d = b.abs().amax(-1) / top  # float32 division, as the C
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv.unsqueeze(-1)).clamp(-top, top)  # half to even, as nearbyintf
    return q.reshape(x.shape), d


def reference(x: torch.Tensor, w: QuantWeight, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's formula in float64 (exact but for the inputs' own rounding), and a bound on
    the float32 rounding of its sum: 2 roundings a block term, over K / 32 terms."""
    q, d = quantized_acts(x, bits)
    k = w.shape[1]
    blocks = k // 32
    deq = dequantize(w).double()  # q_w * s + m, exact in float64
    xq = (q.reshape(-1, blocks, 32) * d.unsqueeze(-1)).double().reshape(q.shape)
    want = xq @ deq.t()
    terms = xq.abs() @ deq.abs().t()
    eps = 2.0**-24
    return want, 4 * (blocks + 2) * eps * terms


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("form", ["int8", "Q8_0", "u4-g32", "int4-g64"])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_is_its_formula_and_near_the_float_product(kernel, form, shape, bits) -> None:
    n, k = shape
    w = weight(form, n, k)
    packed = pack(w)
    g = torch.Generator().manual_seed(1)
    for t in (1, 3, 33):
        x = torch.randn(t, k, generator=g) * 3
        bias = torch.randn(n, generator=g)
        out = torch.full((t, n), float("nan"))
        kernel.run(x, packed, bias, out, bits=bits)
        want, rounding = reference(x, w, bits)
        err = (out.double() - bias.double() - want).abs()
        assert (err <= rounding + 1e-30).all(), (form, shape, t, err.max().item())
        # against the float product: each activation off by at most d / 2 of its block
        _, d = quantized_acts(x, bits)
        half_step = (d.double() / 2).repeat_interleave(32, dim=1)  # [T, K]
        act_bound = half_step @ dequantize(w).double().abs().t() + rounding
        true = x.double() @ dequantize(w).double().t()
        assert ((out.double() - bias.double() - true).abs() <= act_bound * 1.0001).all()


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("form", ["Q8_0", "u4-g32"])
def test_every_path_gives_the_same_bits(kernel, form: str, bits: int) -> None:
    assert kernel.paths[0] == "c" and len(kernel.paths) >= 1
    for n, k in SHAPES:
        packed = pack(weight(form, n, k, seed=2))
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(3))
        outs = {}
        for path in kernel.paths:
            outs[path] = torch.empty(9, n)
            kernel.run(x, packed, None, outs[path], path=path, bits=bits)
        for path, out in outs.items():
            assert torch.equal(out, outs["c"]), (path, n, k)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("form", ["int8", "u4-g32"])
def test_a_row_does_not_depend_on_the_batch_or_threads(kernel, form: str, bits: int) -> None:
    w = pack(weight(form, 70, 576, seed=3))
    bias = torch.randn(70)
    x = torch.randn(200, 576)
    full = torch.empty(200, 70)
    kernel.run(x, w, bias, full, threads=2, bits=bits)
    g = torch.Generator().manual_seed(2)
    for t in (1, 2, 3, 5, 8, 17, 32):
        rows = torch.randperm(200, generator=g)[:t]
        out = torch.empty(t, 70)
        kernel.run(x[rows], w, bias, out, threads=1, bits=bits)
        assert torch.equal(out, full[rows]), t


def test_strided_rows(kernel) -> None:
    """x rows of a wider tensor (as an attention output view), y rows of a wider one."""
    w = pack(weight("u4-g32", 40, 64, seed=4))
    wide = torch.randn(6, 100)
    x = wide[:, 10:74]
    out_wide = torch.zeros(6, 50)
    kernel.run(x, w, None, out_wide[:, :40])
    dense = torch.empty(6, 40)
    kernel.run(x.contiguous(), w, None, dense)
    assert torch.equal(out_wide[:, :40], dense) and (out_wide[:, 40:] == 0).all()


def test_the_path_is_the_best_offered_and_a_forced_one_must_be(kernel, monkeypatch) -> None:
    flags = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    offered = {"avx2": "avx2", "avx-vnni": "avx_vnni", "avx512-vnni": "avx512_vnni"}
    for path in kernel.paths[1:]:
        # avx-vnni also runs as AVX-512 VNNI's 256-bit form where the CPU has that instead
        names = [offered[path]] + (["avx512_vnni"] if path == "avx-vnni" else [])
        assert any(f" {name}" in flags for name in names), path
    if " avx512_vnni" in flags and " avx512bw" in flags:
        assert "avx512-vnni" in kernel.paths
    assert kernel.path == kernel.paths[-1]
    monkeypatch.setenv(qdot.PATH_ENV, "avx2")
    assert qdot._chosen(("c", "avx2", "avx512-vnni")) == "avx2"
    monkeypatch.setenv(qdot.PATH_ENV, "avx512-vnni")
    with pytest.raises(ValueError, match="this CPU offers c, avx2"):
        qdot._chosen(("c", "avx2"))  # a host without VNNI
    monkeypatch.delenv(qdot.PATH_ENV)
    assert qdot._chosen(("c", "avx2")) == "avx2"
    assert PATHS.index(kernel.path) >= PATHS.index("c")


def test_packing_pads_rows_and_repeats_group_scales() -> None:
    w = weight("int4-g64", 20, 128, seed=5)
    p = pack(w)
    assert p.codes.shape == (2, 4, 4, 64) and p.scales.shape == (2, 4, 16)
    assert (p.n, p.k) == (20, 128)
    # row 3's scales: its 2 groups, each repeated for its 2 blocks; rows 20..31 padded with 0
    assert p.scales[0, :, 3].tolist() == w.scales[3].repeat_interleave(2).tolist()
    assert (p.scales[1, :, 4:] == 0).all() and (p.codes[1].view(4, 4, 16, 4)[:, :, 4:] == 0).all()
