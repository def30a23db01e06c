"""Attention over the paged cache: plain torch ops (SDPA for prefill, bmm for decode), and on
CPU a C kernel for decode rows.

Works on CPU and CUDA. Prefill chunks attend one sequence at a time (causal, offset by the
tokens already cached) through ``scaled_dot_product_attention``. Single-token decode rows on a
CPU go to ``cpu_decode.c`` (see ``cpu_kernel.py``) where it builds and reads the dtype
(float32, bf16): K and V read in place through the block tables, one call a layer for every
decode row. Otherwise (CUDA, fp16, no compiler, ``cpu_kernel=False``: the reference path)
they go in groups of similar context lengths: their K and V blocks gathered once, head-major,
into buffers kept from step to step (a fresh multi-megabyte tensor per layer per step cost
more in page faults than the copy itself), then two ``bmm`` read the gathered blocks in place.

Per-step work is planned once and shared by every layer: the cache positions of the new K/V
(``KVSlots``) and, for decode rows, the kernel's ``KernelPlan`` or (built at first use) the
gather index and padding bias. A step of decode rows only, in one group, reads q and returns
the output with no gather or scatter of rows; its torch attention is plain functions of
tensors (``write_kv_slots``, ``decode_attention``), which is what a compiled decode step calls
(engine/compile.py keeps the torch path).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.attention.cpu_kernel import CpuDecodeKernel, KernelPlan, load_kernel

logger = logging.getLogger(__name__)


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
    keeps these in place; a write through a view of the cache became a copy of all of it."""
    kv_cache.index_put_((slots.blocks, slots.k_sel, slots.offsets), k.to(kv_cache.dtype))
    kv_cache.index_put_((slots.blocks, slots.v_sel, slots.offsets), v.to(kv_cache.dtype))


def decode_attention(
    q: torch.Tensor,  # [Bd, H, D], one query row per sequence
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KV, D]
    index: torch.Tensor,  # [2 * Bd * KV * L] cache rows of D values: K, then V
    bias: torch.Tensor,  # [Bd * KV, 1, L]: 0 to attend, -inf past a sequence's end
    scale: float,
    out: torch.Tensor | None = None,  # [2 * Bd * KV * L, D]: where the gather goes
) -> torch.Tensor:  # [Bd, H, D]
    """One gather, two bmm. ``index`` names, for every sequence, KV head and position, the
    cache row holding its K (then V), so one ``index_select`` writes them straight into
    [2, Bd * KV, L, D]: a plain batch of matrices. (SDPA needed [Bd, KV, L, D] from a block
    gather plus a transposing copy, and its masked kernel was slower than two bmm here.)"""
    heads, dim = kv_cache.shape[3], kv_cache.shape[4]
    nb = q.shape[0]
    kv = torch.index_select(kv_cache.view(-1, dim), 0, index, out=out)
    kv = kv.view(2, nb * heads, -1, dim).to(q.dtype)  # [2, Bd * KV, L, D]
    qg = q.reshape(nb * heads, -1, dim)  # [Bd * KV, G, D]: the query heads sharing a KV head
    scores = torch.baddbmm(bias.to(q.dtype), qg, kv[0].transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(dim=-1), kv[1]).view(nb, -1, dim)


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
    strided_inputs = True

    def __init__(self, device: torch.device, cpu_kernel: bool = True) -> None:
        """``cpu_kernel``: on a CPU device, decode rows go to the C kernel where it builds and
        supports the dtype (float32, bf16); False keeps the torch path (the reference)."""
        self.device = device
        self._work = _Workspace(device)
        self._slots: KVSlots | None = None
        self._block_size = 0
        self._prefills: list[_PrefillItem] = []
        self._decode_rows: tuple[list[int], list[list[int]], list[int]] = ([], [], [])
        self._decode: list[_DecodeGroup] | None = None  # torch path, built on first use a step
        self._kernel = load_kernel() if cpu_kernel and device.type == "cpu" else None
        if self._kernel is not None:
            self.name = "torch+cpu-kernel"  # what the start-up log line says
        self._kernel_plan: KernelPlan | None = None
        self._kernel_refused: set[tuple] = set()

    def plan(self, metadata: AttentionMetadata) -> None:
        self._slots = KVSlots.from_slots(metadata.slot_mapping, metadata.block_size)
        self._block_size = metadata.block_size
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
        self._decode_rows = (decode_rows, decode_tables, decode_lens)
        self._decode = None
        self._kernel_plan = None
        if self._kernel is not None and decode_rows:
            self._kernel_plan = KernelPlan.build(decode_rows, decode_lens, decode_tables, bs)

    def _groups(self) -> list[_DecodeGroup]:
        """The torch path's decode groups, rows in step order within each (see ``_one_group``)."""
        if self._decode is None:
            rows, tables, lens = self._decode_rows
            order = sorted(range(len(rows)), key=lambda i: len(tables[i]))
            self._decode = [
                self._decode_group(
                    [rows[i] for i in group],
                    [tables[i] for i in group],
                    [lens[i] for i in group],
                    self._block_size,
                )
                for group in map(sorted, _buckets(order, [len(t) for t in tables]))
            ]
        return self._decode

    def _one_group(self) -> bool:
        """Decode rows only, in one group: rows 0..T-1 in order, no gather or scatter of q."""
        return not self._prefills and len(self._groups()) == 1

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
            bias=torch.zeros(len(lens), 1, max_blocks * bs, device=self.device).masked_fill(
                (key_pos[None, :] >= seq_lens[:, None])[:, None, :], float("-inf")
            ),
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
        if self._slots is None:
            raise RuntimeError("plan() must run before forward()")
        write_kv_slots(kv_cache, self._slots, k, v)
        kernel = self._kernel_for(q, kv_cache)
        if kernel is None and self._one_group():
            return self._decode_attention(q, kv_cache, self._groups()[0], scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
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
        if kernel is not None and self._kernel_plan is not None:
            kernel.run(q, kv_cache, self._kernel_plan, scale, out)
            return out
        for group in self._groups():
            out[group.rows] = self._decode_attention(q[group.rows], kv_cache, group, scale)
        return out

    def _kernel_for(self, q: torch.Tensor, kv_cache: torch.Tensor) -> CpuDecodeKernel | None:
        """The C kernel when this step has decode rows and it reads these tensors."""
        if self._kernel is None or self._kernel_plan is None:
            return None
        if self._kernel.supports(q, kv_cache):
            return self._kernel
        key = (q.dtype, kv_cache.dtype, kv_cache.shape[2], kv_cache.shape[4])
        if key not in self._kernel_refused:
            self._kernel_refused.add(key)
            logger.info(
                "CPU decode attention kernel reads float32 / bf16, head sizes a multiple of 16; "
                "%s queries over a %s cache, block %d, head %d: decode attention through torch",
                *key,
            )
        return None

    def decode_step(self, heads: int) -> tuple[KVSlots, torch.Tensor, torch.Tensor] | None:
        """A planned step of decode rows only, in one group, as tensors alone: (slots, gather
        index, bias) for ``decode_attention``; None for any other step."""
        if self._slots is None or not self._one_group():
            return None
        group = self._groups()[0]
        index, bias = group.gather_plan(heads, self._block_size)
        return self._slots, index, bias

    def _decode_attention(
        self, q: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup, scale: float
    ) -> torch.Tensor:  # q: [Bd, H, D] -> [Bd, H, D]
        index, bias = group.gather_plan(kv_cache.shape[3], kv_cache.shape[2])
        kv = self._work.take("kv", (index.numel(), kv_cache.shape[4]), kv_cache.dtype)
        return decode_attention(q, kv_cache, index, bias, scale, out=kv)


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
