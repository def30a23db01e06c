"""Paged attention as plain torch functions, shared by the torch backend (torch_backend.py) and
the compiled decode step (engine/compile.py): where new K/V go (``KVSlots``), decode rows
gathered and attended by two ``bmm`` (``decode_attention``, planned per group of similar
lengths by ``DecodeGroup``), buffers kept across steps (``Workspace``). An int8 cache
(kv_quant.py) is quantized as written and dequantized as gathered."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.engine.attention.kv_quant import dequantize_rows, is_int8, quantize_rows


@dataclass(frozen=True)
class KVSlots:
    """Where each new token's K and V go: ``kv_cache[blocks, sel, offsets]`` (sel 0 = K)."""

    blocks: torch.Tensor  # [T] block id
    offsets: torch.Tensor  # [T] row within the block
    k_sel: torch.Tensor  # [T] zeros
    v_sel: torch.Tensor  # [T] ones

    @classmethod
    def from_slots(cls, slots: torch.Tensor, block_size: int) -> KVSlots:
        blocks = slots // block_size
        return cls(blocks, slots % block_size, torch.zeros_like(slots), torch.ones_like(slots))


def write_kv_slots(
    kv_cache: torch.Tensor, slots: KVSlots, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Two ``index_put_`` a layer (k, v: [T, KV, D], strided views welcome). torch.compile
    keeps these in place; a write through a view of the cache became a copy of all of it.
    An int8 cache gets each row quantized on its own (kv_quant.py)."""
    if is_int8(kv_cache):
        k, v = quantize_rows(k), quantize_rows(v)
    kv_cache.index_put_((slots.blocks, slots.k_sel, slots.offsets), k.to(kv_cache.dtype))
    kv_cache.index_put_((slots.blocks, slots.v_sel, slots.offsets), v.to(kv_cache.dtype))


def decode_attention(
    q: torch.Tensor,  # [Bd, H, D], one query row per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KV, W]: W = D, or D + 4 in int8
    index: torch.Tensor,  # [2 * Bd * KV * L] cache rows of W values: K, then V
    bias: torch.Tensor,  # [Bd * KV, 1, L]: 0 to attend, -inf past a sequence's end
    scale: float,
    out: torch.Tensor | None = None,  # [2 * Bd * KV * L, W]: where the gather goes
) -> torch.Tensor:  # [Bd, H, D]
    """One gather, two bmm. ``index`` names, for every sequence, KV head and position, the
    cache row holding its K (then V), so one ``index_select`` writes them straight into
    [2, Bd * KV, L, D]: a plain batch of matrices. (SDPA needed [Bd, KV, L, D] from a block
    gather plus a transposing copy, and its masked kernel was slower than two bmm here.)"""
    heads, width = kv_cache.shape[3], kv_cache.shape[4]
    nb, dim = q.shape[0], q.shape[2]
    kv = torch.index_select(kv_cache.view(-1, width), 0, index, out=out)
    if is_int8(kv_cache):
        kv = dequantize_rows(kv)
    kv = kv.view(2, nb * heads, -1, dim).to(q.dtype)  # [2, Bd * KV, L, D]
    qg = q.reshape(nb * heads, -1, dim)  # [Bd * KV, G, D]: the query heads sharing a KV head
    scores = torch.baddbmm(bias.to(q.dtype), qg, kv[0].transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(dim=-1), kv[1]).view(nb, -1, dim)


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [Bd] query row of each decode sequence
    blocks: torch.Tensor  # [Bd, max_blocks]
    bias: torch.Tensor  # [Bd, 1, max_blocks * block_size]: 0 to attend, -inf for padding
    max_len: int
    _plan: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather_plan(self, heads: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index [2 * Bd * KV * max_len], bias [Bd * KV, 1, max_len]), made at the first
        layer of a step and shared by the rest. Cache row of (block b, K/V s, slot t, head h):
        ((b * 2 + s) * block_size + t) * KV + h, the cache seen as [rows, D]."""
        if self._plan is None:
            nb, max_blocks = self.blocks.shape
            dev = self.blocks.device
            s = torch.arange(2, device=dev).view(2, 1, 1, 1, 1)
            b = self.blocks.view(1, nb, 1, max_blocks, 1)
            h = torch.arange(heads, device=dev).view(1, 1, heads, 1, 1)
            t = torch.arange(block_size, device=dev).view(1, 1, 1, 1, block_size)
            index = ((b * 2 + s) * block_size + t) * heads + h  # [2, Bd, KV, max_blocks, bs]
            bias = self.bias.repeat_interleave(heads, dim=0)
            self._plan = (index.reshape(-1), bias)
        return self._plan


class Workspace:
    """Flat buffers reused across layers and steps, grown to the largest request up to
    ``max_bytes`` (beyond it a request gets a one-off tensor)."""

    def __init__(self, device: torch.device, max_bytes: int = 256 << 20) -> None:
        self.device = device
        self.max_bytes = max_bytes
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        if n * dtype.itemsize > self.max_bytes:
            return torch.empty(shape, dtype=dtype, device=self.device)
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(name, dtype)] = torch.empty(n, dtype=dtype, device=self.device)
        return buf[:n].view(shape)


def buckets(order: list[int], num_blocks: list[int]) -> list[list[int]]:
    """Split rows (sorted by length) into groups padded to at most 2x their shortest row, so
    one long context does not make every short one gather and attend over its length."""
    groups: list[list[int]] = []
    for i in order:
        if groups and num_blocks[i] <= 2 * num_blocks[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def gather_blocks(
    kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V: [seq_len, KV, D], float32 from an int8 cache
    kv = kv_cache[blocks]  # [nb, 2, bs, KV, W]
    k = kv[:, 0].reshape(-1, *kv.shape[3:])[:seq_len]
    v = kv[:, 1].reshape(-1, *kv.shape[3:])[:seq_len]
    if is_int8(kv_cache):
        return dequantize_rows(k), dequantize_rows(v)
    return k, v
