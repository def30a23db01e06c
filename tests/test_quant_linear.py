"""The quantized linear kernel (engine/quant/cpu_qlinear.c) and ``QuantLinear``: every weight
form against ``dequantize`` then a float64 matmul, within float32 summation error; a row's
result whatever the batch and thread count; the torch fallback; dtypes and strides.

Tolerance: the kernel's weights are exactly ``dequantize``'s (module docstring of the C file);
output (t, n) sums K/8 products per lane with FMAs, then 8 lanes in 3 rounds, then the bias:
|error| <= (K/8 + 4) u (sum_k |w x| + |b|), u = 2^-24. Observed errors are ~100x smaller;
a wrong nibble order, scale or row is off by O(1).
"""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine.quant import kernel as qkernel
from pdserve.engine.quant.kernel import find_compiler, load_kernel
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.weights import QuantWeight, dequantize, quantize_int4, quantize_int8

U = 2.0**-24
BATCHES = [1, 3, 8, 33, 200]


@pytest.fixture
def kernel() -> qkernel.QLinearKernel:
    """The built kernel: `make test` installs a C compiler, so a failed build fails here."""
    k = load_kernel()
    assert k is not None, f"the quantized linear kernel did not build (compiler: {find_compiler()})"
    return k


def random_weight(form: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Codes over their whole range and random float16 scales (and mins)."""
    g = torch.Generator().manual_seed(seed)
    if form == "int8":  # --quantization int8: from floats, a scale per row
        return quantize_int8(torch.randn(n, k, generator=g))
    if form == "int4-g64":
        return quantize_int4(torch.randn(n, k, generator=g), 64)
    group = 32
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 1e-3).half()
    if form == "Q8_0":  # i8, a scale per 32 weights
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        return QuantWeight("i8", codes, scales, None, group, form)
    nibbles = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    mins = (-torch.rand(n, k // group, generator=g)).half()
    packed = nibbles.reshape(n, k // 32, 2, 16)
    packed = (packed[:, :, 0] | (packed[:, :, 1] << 4)).reshape(n, k // 2)  # llama.cpp order
    return QuantWeight("u4", packed, scales, mins, group, form)


def bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float32 summation error bound of the module docstring, per output element."""
    k = w.shape[1]
    mass = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        mass = mass + bias.double().abs()
    return (k / 8 + 4) * U * mass


@pytest.mark.parametrize("form", ["int8", "Q8_0", "u4-g32", "int4-g64"])
@pytest.mark.parametrize("k", [576, 1536])
def test_kernel_is_the_dequantized_matmul(kernel, form: str, k: int) -> None:
    n = 130  # not a multiple of the kernel's 4-row blocks
    w = random_weight(form, n, k)
    dense = dequantize(w)
    g = torch.Generator().manual_seed(1)
    for with_bias in (False, True):
        bias = torch.randn(n, generator=g) if with_bias else None
        for t in BATCHES:
            x = torch.randn(t, k, generator=g)
            out = torch.full((t, n), float("nan"))
            kernel.run(x, w, bias, out)
            want = x.double() @ dense.double().t() + (0 if bias is None else bias.double())
            err = (out.double() - want).abs()
            assert (err <= bound(x, dense, bias)).all(), (form, t, with_bias, err.max().item())


@pytest.mark.parametrize("form", ["int8", "u4-g32"])
def test_a_row_does_not_depend_on_the_batch_or_threads(kernel, form: str) -> None:
    """The same bits for a row alone, among 2 / 3 / 8 / 33 others, and with 2 threads."""
    w = random_weight(form, 70, 576, seed=3)
    bias = torch.randn(70)
    x = torch.randn(200, 576)
    full = torch.empty(200, 70)
    kernel.run(x, w, bias, full, threads=2)
    g = torch.Generator().manual_seed(2)
    for t in (1, 2, 3, 5, 8, 33):
        rows = torch.randperm(200, generator=g)[:t]
        out = torch.empty(t, 70)
        kernel.run(x[rows], w, bias, out, threads=1)
        assert torch.equal(out, full[rows]), t


def test_strided_rows_and_other_dtypes(kernel) -> None:
    """x rows of a wider tensor (as the attention output view) and bf16 / fp16 activations:
    converted to float32, computed, rounded back once."""
    w = random_weight("u4-g32", 40, 64, seed=4)
    layer = QuantLinear(w, torch.randn(40))
    wide = torch.randn(5, 96)
    x = wide[:, 16:80]  # rows 96 floats apart
    want = torch.empty(5, 40)
    kernel.run(x.contiguous(), w, layer.bias, want)
    assert torch.equal(layer(x), want)
    for dtype in (torch.bfloat16, torch.float16):
        xl = x.to(dtype)
        out = layer(xl)
        exact = torch.empty(5, 40)
        kernel.run(xl.float(), w, layer.bias, exact)
        assert out.dtype == dtype and torch.equal(out, exact.to(dtype))
    assert layer.weight_bytes == w.nbytes + 40 * 4
    assert (layer.in_features, layer.out_features) == (64, 40)
    layer.to(torch.bfloat16)  # as a model-wide cast would: the weight stays what it was
    assert torch.equal(layer(x), want) and layer.scales.dtype == torch.int16


def test_torch_fallback_without_a_compiler(kernel, monkeypatch, caplog) -> None:
    """No compiler: logged once (by the kernel module and once by QuantLinear), and the
    dequantize + matmul path equals the kernel within float32 rounding (two summation
    orders of the same exact products), tiles of rows included."""
    w = random_weight("Q8_0", 70, 576, seed=5)
    bias = torch.randn(70)
    x = torch.randn(9, 576)
    want = QuantLinear(w, bias)(x)
    monkeypatch.setattr(qkernel, "find_compiler", lambda: None)
    monkeypatch.setattr("pdserve.engine.quant.linear.TORCH_TILE_ROWS", 32)
    monkeypatch.setattr("pdserve.engine.quant.linear._logged", set())
    load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.engine.quant"):
            layers = [QuantLinear(w, bias), QuantLinear(w, None)]
    finally:
        load_kernel.cache_clear()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "no C compiler" in messages[0] and "through torch" in messages[1]
    tol = 2 * bound(x, dequantize(w), bias)
    for got in (layers[0](x), layers[1](x) + bias):
        assert ((got.double() - want.double()).abs() <= tol).all()


def test_failed_build_falls_back(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setattr(qkernel, "find_compiler", lambda: "/bin/false")
    monkeypatch.setattr(qkernel, "pdserve_home", lambda: tmp_path)
    load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.engine.quant.kernel"):
            assert load_kernel() is None
    finally:
        load_kernel.cache_clear()
    assert "unavailable" in caplog.text
    assert list((tmp_path / "kernels").iterdir()) == []  # no temporary file left behind


def test_custom_op_for_torch_compile(kernel) -> None:
    """``pdserve::qlinear`` (what a compiled graph calls) gives the kernel's bits, and its fake
    implementation the output's shape (torch.library.opcheck runs both)."""
    w = random_weight("u4-g32", 12, 64, seed=6)
    x, bias = torch.randn(3, 64), torch.randn(12)
    assert w.mins is not None
    args = (x, w.data, w.scales.view(torch.int16), w.mins.view(torch.int16), bias, 1, 32, 12)
    want = torch.empty(3, 12)
    kernel.run(x, w, bias, want)
    assert torch.equal(torch.ops.pdserve.qlinear(*args), want)
    torch.library.opcheck(
        torch.ops.pdserve.qlinear.default, args, test_utils=("test_schema", "test_faketensor")
    )
