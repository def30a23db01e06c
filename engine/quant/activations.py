"""What a model's quantized layers multiply: float32, int16 or int8 activations
(--quant-activations).

    float32  each weight dequantized to float32 in registers (cpu_qlinear.c): exact to the
             weights (the tokens of transformers on the same checkpoint), bound by arithmetic
    int16    activations quantized per 32 values to int16, integer dot products (cpu_qdot.c):
             as fast as int8 where a step reads its weights (one stream), 1/256 of its rounding
    int8     the same in int8 (llama.cpp's way): twice int16's arithmetic rate, for many
             streams, at llama.cpp's quality (a chat answer can go astray; the README's table)
    auto     int16 wherever the kernel builds (a CPU with a C compiler), else float32

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

BITS = {"int8": 8, "int16": 16, "auto": 16}


def set_activations(model: CausalLM, mode: str) -> str:
    """Make ``model``'s quantized layers take ``mode``'s activations (in place); returns what
    they run: "float32", or "int16 (<instruction path>)"; "" for a model with none."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return ""
    if mode == "float32":
        return "float32"
    on_cpu = all(m.codes.device.type == "cpu" for m in layers)
    kernel = load_kernel() if on_cpu else None
    if kernel is None:
        if mode != "auto":
            where = "a CPU" if not on_cpu else "its kernel (no C compiler or the build failed)"
            raise RuntimeError(f"--quant-activations {mode} needs {where}")
        return "float32"
    bits = BITS[mode]
    for layer in layers:
        layer.use_integer_activations(kernel, bits)
    model.quantization = f"{model.quantization}, int{bits} activations"
    return f"int{bits} ({kernel.path})"
