"""What a model's quantized layers multiply: float32 or int8 activations (--quant-activations).

    float32  each weight dequantized to float32 in registers (cpu_qlinear.c): exact to the
             weights, bound by arithmetic on a CPU
    int8     activations quantized per 32 values, integer dot products (cpu_qdot.c): llama.cpp's
             way, 2-4x faster; its own numbers, so its own weight form for pairing
    auto     int8 wherever its kernel builds (a CPU with a C compiler), else float32

The quality of int8 activations against float32 ones is measured by
bench/experiments/quant_quality.py (the README's table). The choice changes the values the
model computes, so it is part of ``CausalLM.quantization``: a prefill and a decode worker
that chose differently never pair (their KV would differ).
"""

from __future__ import annotations

import logging

from pdserve.engine.model import CausalLM
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.qdot import load_kernel

logger = logging.getLogger(__name__)

INT8_LABEL = "int8 activations"


def set_activations(model: CausalLM, mode: str) -> str:
    """Make ``model``'s quantized layers take ``mode``'s activations (in place); returns what
    they run: "float32", or "int8 (<instruction path>)"; "" for a model with none."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return ""
    if mode == "float32":
        return "float32"
    on_cpu = all(m.codes.device.type == "cpu" for m in layers)
    kernel = load_kernel() if on_cpu else None
    if kernel is None:
        if mode == "int8":
            where = "a CPU" if not on_cpu else "its kernel (no C compiler or the build failed)"
            raise RuntimeError(f"--quant-activations int8 needs {where}")
        return "float32"
    for layer in layers:
        layer.use_int8_activations(kernel)
    model.quantization = f"{model.quantization}, {INT8_LABEL}"
    return f"int8 ({kernel.path})"
