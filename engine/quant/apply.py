"""``quantize_model``: a float ``CausalLM``'s linear layers made ``QuantLinear`` at load.

nn.Linear (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) ──▶ QuantLinear
tied embedding ──▶ tied_head = QuantLinear(quantized copy); the lookup keeps the float one

int8  one scale per output row (symmetric)         model.quantization = "int8"
int4  a scale and a minimum per group_size weights model.quantization = "int4-g<size>"
      the output head (lm_head or the tied one) stays int8, as llama.cpp keeps it at 8 bits
      or more in its 4-bit files: on SmolLM2-135M an int4 head alone raised perplexity by
      7.3%, an int8 one by 0.05% (bench/experiments/quant_quality.py)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.model import CausalLM
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.weights import QuantWeight, quantize_int4, quantize_int8

METHODS = ("int8", "int4")


def quantize_model(model: CausalLM, method: str, group_size: int) -> None:
    """Swap every ``nn.Linear`` of ``model`` (and a tied head) for a ``QuantLinear`` in place;
    ``ValueError`` naming the layer when ``group_size`` does not fit its width."""
    quantize, label = _method(method, group_size)
    swaps = [
        (parent, f"{prefix}.{name}".lstrip("."), name, child)
        for prefix, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, qualified, name, child in swaps:
        how = quantize_int8 if child is model.lm_head else quantize
        setattr(parent, name, QuantLinear(_quantized(how, child.weight, qualified), child.bias))
    if model.lm_head is None:
        head = _quantized(quantize_int8, model.head_weight(), "embed_tokens (tied)")
        model.tied_head = QuantLinear(head, None)
    model.quantization = label


def _method(method: str, group_size: int) -> tuple[Callable[[torch.Tensor], QuantWeight], str]:
    if method == "int8":
        return quantize_int8, "int8"
    if method == "int4":
        return (lambda w: quantize_int4(w, group_size)), f"int4-g{group_size}"
    raise ValueError(f"quantization method must be one of {', '.join(METHODS)}, got {method!r}")


def _quantized(
    quantize: Callable[[torch.Tensor], QuantWeight], weight: torch.Tensor, name: str
) -> QuantWeight:
    try:
        return quantize(weight)
    except ValueError as e:
        raise ValueError(f"{name} [{weight.shape[0]}, {weight.shape[1]}]: {e}") from e
