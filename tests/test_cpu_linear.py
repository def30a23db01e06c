"""engine.cpu_linear: oneDNN-packed linear layers equal nn.Linear; dtypes this CPU cannot
pack (bf16 without AVX-512, float16 always) are refused with a reason, and the engine keeps
torch's layers for them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.cpu_linear import PackedLinear, onednn_status, pack_linears


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_linear_where_usable(dtype: torch.dtype) -> None:
    usable, reason = onednn_status(dtype)
    if not usable:  # e.g. bf16 on an AVX2-only CPU: the reason names the dtype
        assert str(dtype) in reason
        return
    torch.manual_seed(0)
    layer = nn.Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(5, 64, dtype=dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        PackedLinear(layer.weight, layer.bias)(x), layer(x), rtol=tol, atol=tol
    )


def test_float16_is_not_packable() -> None:
    usable, reason = onednn_status(torch.float16)
    assert not usable and "float16" in reason


def test_pack_linears_swaps_every_linear() -> None:
    if not onednn_status(torch.float32)[0]:
        pytest.skip("torch here has no oneDNN")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    before = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
