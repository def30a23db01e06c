"""Linear layers through oneDNN with weights packed once, for CPU decode and prefill.

``F.linear`` on a CPU build of torch calls MKL's sgemm. On the AMD EPYC cores this project
runs on, MKL takes a slow path: measured (one thread, SmolLM2-135M's 30 layers of weights,
far larger than the caches) MKL reads weights at 16.6 GB/s at batch 1 and reaches 36 / 71
GFLOP/s at batch 8 / 32, while oneDNN on weights reordered into its own blocked layout
reads at 31 GB/s (the core's DRAM rate is ~36) and reaches 91 / 172 GFLOP/s. vLLM's CPU
build routes its linear layers through oneDNN too.

    nn.Linear(E, F) ── pack once at load ──▶ PackedLinear: oneDNN-layout weight [F, E]
    forward(x [T, E]) = torch.ops.mkldnn._linear_pointwise(x, packed, bias) -> [T, F]

The dense weight is dropped once packed (same memory). Results differ from MKL's by float32
rounding (summation order), well under the gap between two logits greedy decoding picks from.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

PACKABLE = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_status(dtype: torch.dtype = torch.float32) -> tuple[bool, str]:
    """Whether packed oneDNN linear layers of ``dtype`` run here (checked once on a tiny
    layer). bf16 needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT: an AVX2-only CPU has fp32 only."""
    if dtype not in PACKABLE:
        return False, f"oneDNN packing is for {', '.join(map(str, PACKABLE))}, not {dtype}"
    # the ignore: torch leaves mkldnn.is_available unannotated
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False, "torch was built without oneDNN (mkldnn)"
    try:
        w, x = torch.randn(8, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not torch.allclose(out.float(), (x @ w.t()).float(), rtol=tol, atol=tol):
            return False, f"oneDNN {dtype} linear gave wrong results on a probe"
    except (RuntimeError, AttributeError) as exc:
        return False, f"oneDNN {dtype} linear unavailable: {exc}"
    return True, f"oneDNN packed linear layers (torch {torch.__version__})"


def use_onednn(choice: str, dtype: torch.dtype, flag: str, what: str) -> bool:
    """Whether ``what`` (linear layers) go through oneDNN for ``choice``: auto where it runs
    here (else through torch, logged), onednn or an error naming ``flag`` and why, torch never."""
    if choice == "torch":
        return False
    usable, reason = onednn_status(dtype)
    if usable:
        return True
    if choice == "onednn":
        raise RuntimeError(f"{flag} onednn: {reason}")
    logger.info("%s through torch: %s", what, reason)
    return False


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's blocked layout (a buffer, not a param)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        # torch.ops calls are typed Any (resolved at run time)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], ""
        )
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Swap every CPU ``nn.Linear`` of a packable dtype for a ``PackedLinear``; returns how
    many were packed."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
        and child.weight.device.type == "cpu"
        and child.weight.dtype in PACKABLE
    ]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(swaps)


def packed_head(weight: torch.Tensor) -> PackedLinear | None:
    """A packed copy of a tied output embedding (the lookup keeps the dense one)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE:
        return None
    return PackedLinear(weight, None)
