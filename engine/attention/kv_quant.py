"""The int8 KV cache (``--kv-cache-dtype int8``): each (token, KV head) row of K or V stored as
``head_dim`` int8 values and their float32 scale, symmetric, in one int8 tensor per layer::

    kv_cache[layer]: int8 [num_blocks, 2, block_size, num_kv_heads, head_dim + 4]

    one row (token t, head h, K or V), head_dim + 4 bytes:
    ┌────┬────┬─────┬──────────────┬───────────────┐
    │ q0 │ q1 │ ... │ q[head_dim-1]│ scale float32 │   x[i] ≈ q[i] * scale
    └────┴────┴─────┴──────────────┴───────────────┘   scale = max|x| / 127, q = round(x / scale)

A block stays one self-contained run of bytes (transfers, block copies and the prefix cache
move it whole). Each row is quantized alone, so a token's stored bytes are the same whichever
batch, chunk or worker wrote it. Scales per row rather than per block: a block written a token
at a time (decode) would otherwise rescale the rows already in it. Bytes a token against
float32: 4 D / (D + 4): 3.76x fewer at D = 64, 3.88x at D = 128 (1.9x against bf16).

``torch.int8`` marks the form: no model runs in int8, so a cache tensor of that dtype is this
layout (``is_int8``), and its ``KVLayout`` reads ``dtype="int8"``, ``head_dim`` = D + 4 (the
bytes a row takes, which is what sizes a transfer).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 after the row's int8 values
QMAX = 127.0


def is_int8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == torch.int8


def row_width(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of the cache's last dimension for a head size: D, or D + 4 bytes in int8."""
    return head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The model's head size of a cache ``[num_blocks, 2, block_size, KV, W]``."""
    return kv_cache.shape[-1] - SCALE_BYTES if is_int8(kv_cache) else kv_cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:  # [..., D] float -> [..., D + 4] int8
    """Rows of int8 values and their float32 scale (strided views welcome)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / QMAX  # [..., 1]
    # an all-zero row: any scale gives zeros; the smallest normal float keeps x / s finite
    scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
    q = (x / scale).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:  # [..., D + 4] int8 -> [..., D] f32
    """The float32 values of int8 rows (any leading shape, contiguous or not)."""
    q = rows[..., :-SCALE_BYTES].float()
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return q * scale
