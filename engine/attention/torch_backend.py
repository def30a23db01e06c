"""Attention over the paged cache: plain torch ops (SDPA for prefill, bmm for decode), and on
CPU a C kernel for decode rows.

An int8 cache (``--kv-cache-dtype int8``, kv_quant.py) is quantized row by row as written; the C
kernel reads it in place, the torch paths dequantize what they gather.

Works on CPU and CUDA. Prefill chunks attend one sequence at a time (causal, offset by the
tokens already cached) through ``scaled_dot_product_attention``. Single-token decode rows on a
CPU go to ``cpu_decode.c`` (see ``cpu_kernel.py``) where it builds and reads the dtype
(float32, bf16, int8): K and V read in place through the block tables, one call a layer for every
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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.attention.cpu_kernel import CpuDecodeKernel, KernelPlan, load_kernel
from pdserve.engine.attention.kv_quant import head_dim_of
from pdserve.engine.attention.torch_ops import (
    DecodeGroup,
    KVSlots,
    Workspace,
    buckets,
    decode_attention,
    gather_blocks,
    write_kv_slots,
)
from pdserve.protocol.blocks import blocks_for

logger = logging.getLogger(__name__)

# queries of a sequence, at most, that attend as decode rows (a verification's 1 + k drafts)
# when it has more context than that: no gather of its blocks, the decode kernel reads them
SHORT_QUERY = 17


@dataclass
class _PrefillItem:
    start: int
    end: int
    blocks: torch.Tensor  # [num_blocks] block ids
    seq_len: int
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when plain causal applies


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    strided_inputs = True

    def __init__(self, device: torch.device, cpu_kernel: bool = True) -> None:
        """``cpu_kernel``: on a CPU device, decode rows go to the C kernel where it builds and
        supports the dtype (float32, bf16); False keeps the torch path (the reference)."""
        self.device = device
        self._work = Workspace(device)
        self._slots: KVSlots | None = None
        self._block_size = 0
        self._prefills: list[_PrefillItem] = []
        self._decode_rows: tuple[list[int], list[list[int]], list[int]] = ([], [], [])
        self._decode: list[DecodeGroup] | None = None  # torch path, built on first use a step
        self._kernel = load_kernel() if cpu_kernel and device.type == "cpu" else None
        if self._kernel is not None:
            self.name = "torch+cpu-kernel"  # what the start-up log line says
        self._kernel_plan: KernelPlan | None = None
        # (q dtype, cache dtype, block size, head size) already logged as refused
        self._kernel_refused: set[tuple[torch.dtype, torch.dtype, int, int]] = set()

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
            num_blocks = blocks_for(seq_len, bs)
            if q_len == 1:
                decode_rows.append(start)
                decode_tables.append(table[:num_blocks])
                decode_lens.append(seq_len)
            elif q_len <= SHORT_QUERY < seq_len:
                # a verification (engine/spec/) or a short chunk over a context: each query is
                # a decode row seeing the keys up to its own position (its K/V are written first)
                for i in range(q_len):
                    row_len = seq_len - q_len + i + 1
                    decode_rows.append(start + i)
                    decode_tables.append(table[: blocks_for(row_len, bs)])
                    decode_lens.append(row_len)
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

    def _groups(self) -> list[DecodeGroup]:
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
                for group in map(sorted, buckets(order, [len(t) for t in tables]))
            ]
        return self._decode

    def _one_group(self) -> bool:
        """Decode rows only, in one group: rows 0..T-1 in order, no gather or scatter of q."""
        return not self._prefills and len(self._groups()) == 1

    def _decode_group(
        self, rows: list[int], tables: list[list[int]], lens: list[int], bs: int
    ) -> DecodeGroup:
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        key_pos = torch.arange(max_blocks * bs, device=self.device)
        seq_lens = torch.tensor(lens, device=self.device)
        return DecodeGroup(
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
            kc, vc = gather_blocks(kv_cache, item.blocks, item.seq_len)  # [L, KV, D]
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
        key = (q.dtype, kv_cache.dtype, kv_cache.shape[2], head_dim_of(kv_cache))
        if key not in self._kernel_refused:
            self._kernel_refused.add(key)
            logger.info(
                "CPU decode attention kernel reads float32 / bf16 (or int8 caches), head sizes a "
                "multiple of 16; "
                "%s queries over a %s cache, block %d, head %d: decode attention through torch",
                *key,
            )
        return None

    def native_decode(self) -> tuple[KVSlots, KernelPlan] | None:
        """A planned step of decode rows only, for the C kernel: its slots and the kernel's
        plan (engine/cpu_layers.py runs the layers around it); None for any other step."""
        if self._prefills or self._slots is None or self._kernel is None:
            return None
        return None if self._kernel_plan is None else (self._slots, self._kernel_plan)

    def decode_step(self, heads: int) -> tuple[KVSlots, torch.Tensor, torch.Tensor] | None:
        """A planned step of decode rows only, in one group, as tensors alone: (slots, gather
        index, bias) for ``decode_attention``; None for any other step."""
        if self._slots is None or not self._one_group():
            return None
        group = self._groups()[0]
        index, bias = group.gather_plan(heads, self._block_size)
        return self._slots, index, bias

    def _decode_attention(
        self, q: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, scale: float
    ) -> torch.Tensor:  # q: [Bd, H, D] -> [Bd, H, D]
        index, bias = group.gather_plan(kv_cache.shape[3], kv_cache.shape[2])
        kv = self._work.take("kv", (index.numel(), kv_cache.shape[4]), kv_cache.dtype)
        return decode_attention(q, kv_cache, index, bias, scale, out=kv)
