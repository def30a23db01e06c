"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and a cos/sin cache.

Matches Hugging Face's ``rotate_half`` convention: the head dimension is split in two halves
(not interleaved pairs). The cached sine has its first half negated, so that
``rotate_half(x) * sin == x.roll(D // 2) * sin_signed``: three tensor ops per call instead of
seven (a slice, a negation and a ``cat`` made ``rotate_half``), for query and key heads at once.
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.config import RopeConfig
from pdserve.engine.cpu_rope import rotate_in_place


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32, computed exactly as transformers does."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Holds cos and signed sin (float32) for every position below ``max_positions``."""

    cos: torch.Tensor  # [max_positions, head_dim], a buffer
    sin_signed: torch.Tensor  # [max_positions, head_dim], a buffer

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":  # replaced once materialised (loader.py):
            shape = (max_positions, head_dim)  # computing it here would be thrown away
            self.register_buffer("cos", torch.empty(shape), persistent=False)
            self.register_buffer("sin_signed", torch.empty(shape), persistent=False)
            return
        inv_freq = inverse_frequencies(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        sin = emb.sin()
        sin[:, : head_dim // 2].neg_()  # rotate_half's sign, folded in (see apply_rotary)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin_signed", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each position, [T, 1, D] in ``dtype``; once per step."""
        return (
            self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
            self.sin_signed.index_select(0, positions).unsqueeze(1).to(dtype),
        )


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, native: bool = True
) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``. x: [T, heads, D]; cos/sin_signed: [T, 1, D].

    ``rotate_half(x) = cat(-x2, x1)`` equals ``roll(x, D/2) = cat(x2, x1)`` with the sign moved
    into ``sin_signed``. On CPU float32 (with ``native``) one C call writes the result over x
    and returns it, the same bits (engine/cpu_rope.py); otherwise a new tensor."""
    if native and rotate_in_place(x, cos, sin_signed):
        return x
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
