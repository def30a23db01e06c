"""Attention over the paged cache with ``torch.nn.functional.scaled_dot_product_attention``.

Works on CPU and CUDA. Prefill chunks attend one sequence at a time (causal, offset by the
tokens already cached); single-token decode rows go through one padded SDPA call per group of
similar context lengths, their K and V gathered into buffers kept from step to step (a fresh
multi-megabyte tensor per layer per step cost more in page faults than the copy itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata, write_kv


@dataclass
class _PrefillItem:
    start: int
    end: int
    blocks: torch.Tensor  # [num_blocks] block ids
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when plain causal applies


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [Bd] query row of each decode sequence
    blocks: torch.Tensor  # [Bd, max_blocks]
    mask: torch.Tensor  # [Bd, 1, 1, max_blocks * block_size] bool: True = attend
    max_len: int


class _Workspace:
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


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._work = _Workspace(device)
        self._meta: AttentionMetadata | None = None
        self._prefills: list[_PrefillItem] = []
        self._decode: list[_DecodeGroup] = []

    def plan(self, metadata: AttentionMetadata) -> None:
        self._meta = metadata
        self._prefills = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        start = 0
        bs = metadata.block_size
        for q_len, seq_len, table in zip(
            metadata.query_lens_cpu,
            metadata.seq_lens_cpu,
            metadata.block_tables_cpu,
            strict=True,
        ):
            num_blocks = -(-seq_len // bs)
            if q_len == 1:
                decode_rows.append(start)
                decode_tables.append(table[:num_blocks])
                decode_lens.append(seq_len)
            else:
                mask = None
                if q_len != seq_len:
                    # query i sits at position seq_len - q_len + i and sees keys up to it
                    q_pos = torch.arange(seq_len - q_len, seq_len, device=self.device)
                    k_pos = torch.arange(seq_len, device=self.device)
                    mask = k_pos[None, :] <= q_pos[:, None]
                blocks = torch.tensor(table[:num_blocks], dtype=torch.long, device=self.device)
                self._prefills.append(_PrefillItem(start, start + q_len, blocks, seq_len, mask))
            start += q_len
        order = sorted(range(len(decode_rows)), key=lambda i: len(decode_tables[i]))
        self._decode = [
            self._decode_group(
                [decode_rows[i] for i in group],
                [decode_tables[i] for i in group],
                [decode_lens[i] for i in group],
                bs,
            )
            for group in _buckets(order, [len(t) for t in decode_tables])
        ]

    def _decode_group(
        self, rows: list[int], tables: list[list[int]], lens: list[int], bs: int
    ) -> _DecodeGroup:
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        key_pos = torch.arange(max_blocks * bs, device=self.device)
        seq_lens = torch.tensor(lens, device=self.device)
        return _DecodeGroup(
            rows=torch.tensor(rows, dtype=torch.long, device=self.device),
            blocks=torch.tensor(padded, dtype=torch.long, device=self.device),
            mask=(key_pos[None, :] < seq_lens[:, None])[:, None, None, :],
            max_len=max_blocks * bs,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        if self._meta is None:
            raise RuntimeError("plan() must run before forward()")
        write_kv(kv_cache, self._meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        for item in self._prefills:
            kc, vc = _gather(kv_cache, item.blocks, item.seq_len)  # [L, KV, D]
            qs = q[item.start : item.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            o = F.scaled_dot_product_attention(
                qs,
                kc.transpose(0, 1).unsqueeze(0).to(q.dtype),
                vc.transpose(0, 1).unsqueeze(0).to(q.dtype),
                attn_mask=item.mask,
                is_causal=item.mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[item.start : item.end] = o[0].transpose(0, 1)
        _, _, bs, heads, dim = kv_cache.shape
        for group in self._decode:
            nb, max_blocks = group.blocks.shape
            shape = (nb * max_blocks, 2, bs, heads, dim)
            gathered = self._work.take("gather", shape, kv_cache.dtype)
            torch.index_select(kv_cache, 0, group.blocks.view(-1), out=gathered)
            kv = self._work.take("kv", (2, nb, heads, max_blocks, bs, dim), q.dtype)
            # [Bd, max_blocks, 2, bs, KV, D] -> [2, Bd, KV, max_blocks, bs, D], one copy
            kv.copy_(gathered.view(nb, max_blocks, 2, bs, heads, dim).permute(2, 0, 4, 1, 3, 5))
            kc = kv[0].view(nb, heads, group.max_len, dim)  # [Bd, KV, max_len, D]
            vc = kv[1].view(nb, heads, group.max_len, dim)
            qd = q[group.rows].unsqueeze(2)  # [Bd, H, 1, D]
            o = F.scaled_dot_product_attention(
                qd, kc, vc, attn_mask=group.mask, scale=scale, enable_gqa=True
            )
            out[group.rows] = o[:, :, 0]
        return out


def _buckets(order: list[int], num_blocks: list[int]) -> list[list[int]]:
    """Split rows (sorted by length) into groups padded to at most 2x their shortest row, so
    one long context does not make every short one gather and attend over its length."""
    groups: list[list[int]] = []
    for i in order:
        if groups and num_blocks[i] <= 2 * num_blocks[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _gather(
    kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    kv = kv_cache[blocks]  # [nb, 2, bs, KV, D]
    k = kv[:, 0].reshape(-1, *kv.shape[3:])[:seq_len]
    v = kv[:, 1].reshape(-1, *kv.shape[3:])[:seq_len]
    return k, v
