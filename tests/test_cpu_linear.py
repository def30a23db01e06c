"""engine.cpu_linear: oneDNN-packed linear layers equal nn.Linear; dtypes this CPU cannot
pack (bf16 without AVX-512, float16 always) are refused with a reason, and the engine keeps
torch's layers for them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.cpu_linear import PackedLinear, onednn_status, pack_linears
from tests.engine_util import greedy, make_engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_equals_linear_or_the_engine_keeps_torch_layers(
    dtype: torch.dtype, tiny_dir
) -> None:
    """Where oneDNN packs ``dtype`` the packed layer equals nn.Linear; where this CPU cannot
    (bf16 without AVX-512) the reason names the dtype, the engine runs on torch's layers and
    ``--cpu-linear onednn`` is refused with that reason. Either way one branch asserts."""
    usable, reason = onednn_status(dtype)
    if not usable:
        assert str(dtype) in reason
        name = str(dtype).removeprefix("torch.")
        engine = make_engine(tiny_dir, dtype=name)
        assert engine.runner.linear == "torch"
        assert not any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
        out = engine.generate([[5, 6, 7]], greedy(3))[0]
        assert len(out.new_token_ids) == 3
        with pytest.raises(RuntimeError, match=f"--cpu-linear onednn: .*{dtype}"):
            make_engine(tiny_dir, dtype=name, cpu_linear="onednn")
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
    usable, reason = onednn_status(torch.float32)
    assert usable, reason  # the pinned CPU torch is built with oneDNN
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(3, 8)
    before = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
