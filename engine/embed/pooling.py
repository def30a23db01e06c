"""Token states → one vector per input, as sentence-transformers' Pooling and Normalize do.

The batch is packed: input ``i`` owns rows ``starts[i]:starts[i] + lengths[i]`` of
``hidden`` [T, E]. Each input is pooled from its own rows alone, so its vector does not
depend on what else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, lengths: Sequence[int], modes: Sequence[str]) -> torch.Tensor:
    """[T, E] packed states → [N, E * len(modes)], the modes' vectors side by side."""
    out = []
    start = 0
    for n in lengths:
        rows = hidden[start : start + n]  # [n, E]
        out.append(torch.cat([_pool_one(rows, mode) for mode in modes]))
        start += n
    if not out:
        return hidden.new_zeros((0, hidden.shape[1] * len(modes)))
    return torch.stack(out)


def _pool_one(rows: torch.Tensor, mode: str) -> torch.Tensor:  # [n, E] -> [E]
    n = int(rows.shape[0])
    if mode == "mean":
        return rows.sum(0) / n
    if mode == "mean_sqrt_len_tokens":
        return rows.sum(0) / math.sqrt(n)
    if mode == "cls":
        return rows[0]
    if mode == "lasttoken":
        return rows[-1]
    if mode == "max":
        return rows.amax(0)
    if mode == "weightedmean":  # token i weighs i + 1
        weights = torch.arange(1, n + 1, dtype=rows.dtype, device=rows.device)
        return (rows * weights[:, None]).sum(0) / weights.sum()
    raise ValueError(f"unknown pooling mode {mode!r}")


def normalize(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (sentence-transformers' Normalize: F.normalize)."""
    return F.normalize(x, p=2.0, dim=-1)
