"""A quantized weight matrix: the one form every quantization here ends in.

    kind "i8": data int8 [N, K];        w[n, k] = q * scale[n, k // group]
    kind "u4": data uint8 [N, K // 2];  w[n, k] = q * scale[n, k // group] + min[n, k // group]
        each 32 weights of a row take 16 bytes: byte j holds weight j in its low nibble and
        weight j + 16 in its high nibble (llama.cpp's Q4 order, so GGUF blocks copy across)
    scales, mins: float16 [N, K // group]; group a multiple of 32 that divides K

    --quantization int8   i8, group = K (one scale per output channel), symmetric
    --quantization int4   u4, group = --quant-group-size, asymmetric (scale and minimum)
    GGUF Q8_0 / Q4_0 / Q4_1   i8 group 32 / u4 group 32 with min = -8 scale / u4 group 32

Activations stay in the model's dtype; ``dequantize`` is the reference every kernel is held to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

BLOCK = 32  # weights per nibble block; every group is a whole number of blocks

QuantKind = Literal["i8", "u4"]


@dataclass(frozen=True)
class QuantWeight:
    kind: QuantKind
    data: torch.Tensor  # i8: int8 [N, K]; u4: uint8 [N, K // 2]
    scales: torch.Tensor  # float16 [N, K // group]
    mins: torch.Tensor | None  # float16 [N, K // group] for u4, None for i8
    group: int
    name: str  # what it came from, for logs and `pdserve models`: int8, int4-g32, Q4_1, ...

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.group % BLOCK or k % self.group:
            raise ValueError(f"group {self.group} must be a multiple of {BLOCK} dividing K={k}")
        if self.scales.dtype != torch.float16 or tuple(self.scales.shape) != (n, k // self.group):
            raise ValueError(f"scales must be float16 [{n}, {k // self.group}]")
        if self.kind == "u4":
            if self.data.dtype != torch.uint8 or self.mins is None:
                raise ValueError("u4 weights are uint8 nibbles with mins")
            if self.mins.dtype != torch.float16 or self.mins.shape != self.scales.shape:
                raise ValueError("mins must be float16 of the scales' shape")
        elif self.data.dtype != torch.int8 or self.mins is not None:
            raise ValueError("i8 weights are int8 without mins")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features N, in_features K)."""
        rows, cols = self.data.shape
        return rows, cols * 2 if self.kind == "u4" else cols

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads: the codes, scales and mins."""
        extra = 0 if self.mins is None else self.mins.nbytes
        return self.data.nbytes + self.scales.nbytes + extra


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [N, K] -> [N, K // 2] in llama.cpp's Q4 order (module docstring)."""
    n, k = q.shape
    blocks = q.reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``: uint8 codes [N, K]."""
    n, half = data.shape
    blocks = data.reshape(n, half * 2 // BLOCK, 1, BLOCK // 2)
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=2).reshape(n, half * 2)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The float32 [N, K] matrix ``w`` stands for (the reference for kernels and tests)."""
    n, k = w.shape
    codes = unpack_nibbles(w.data) if w.kind == "u4" else w.data
    q = codes.float().reshape(n, k // w.group, w.group)
    out = q * w.scales.float().unsqueeze(-1)
    if w.mins is not None:
        out = out + w.mins.float().unsqueeze(-1)
    return out.reshape(n, k)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric, one scale per output channel: q = round(w / s), s = max |w| / 127."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16)
    s = scale.float()
    q = torch.where(s > 0, torch.round(w / s.clamp(min=1e-30)), 0).clamp(-127, 127)
    return QuantWeight("i8", q.to(torch.int8), scale, None, w.shape[1], "int8")


def quantize_int4(weight: torch.Tensor, group: int = BLOCK) -> QuantWeight:
    """Asymmetric per group: q = round((w - min) / s) in 0..15, s = (max - min) / 15; the
    float16-rounded s and min are the ones the codes are computed against."""
    w = weight.detach().float()
    n, k = w.shape
    if group % BLOCK or k % group:
        raise ValueError(f"int4 group size {group} must be a multiple of {BLOCK} dividing {k}")
    g = w.reshape(n, k // group, group)
    lo = g.amin(dim=-1).to(torch.float16)
    scale = ((g.amax(dim=-1) - lo.float()) / 15).to(torch.float16)
    s, m = scale.float().unsqueeze(-1), lo.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round((g - m) / s.clamp(min=1e-30)), 0).clamp(0, 15)
    codes = pack_nibbles(q.to(torch.uint8).reshape(n, k))
    return QuantWeight("u4", codes, scale, lo, group, f"int4-g{group}")
