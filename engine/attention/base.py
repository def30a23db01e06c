"""The attention backend contract.

A step's batch is ragged: sequence ``i`` contributes query rows
``query_start_loc[i]:query_start_loc[i + 1]`` (a prefill chunk, or one decode token) and
attends to its first ``seq_lens[i]`` cached positions, new ones included.

Paged KV layout, one tensor per layer (flashinfer's ``NHD`` layout with K and V together)::

    kv_cache[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]
                                  ^ 0 = K, 1 = V
    token t of a sequence lives in block block_table[t // block_size], row t % block_size
    slot = block_id * block_size + row

With ``--kv-cache-dtype int8`` the tensor is int8 and each (token, head) row carries its scale:
``[num_blocks, 2, block_size, num_kv_heads, head_dim + 4]`` (drawn in kv_quant.py).

The model calls ``plan`` once per step, then ``forward`` once per layer: the backend writes the
new K/V into their slots and returns the attention output for every query row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 on device
    # Host lists: backends plan from these without a device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]  # context length including new tokens
    block_tables_cpu: list[list[int]]
    block_size: int
    # Device forms of the lists, for a backend that wants them; none does yet, so the model
    # runner leaves them out (building them cost a padded copy of every block table a step).
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32
    seq_lens: torch.Tensor | None = None  # [B] int32
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32, padded with 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)


class AttentionBackend(ABC):
    """One instance per model runner; ``plan`` once per step, ``forward`` once per layer."""

    name: str = "abstract"
    # whether ``forward`` takes q and k as strided views of the fused QKV projection (rows
    # (H + 2 * KV) * D apart); backends that do not get contiguous copies
    strided_inputs: bool = False

    @abstractmethod
    def plan(self, metadata: AttentionMetadata) -> None:
        """Prepare per-step state shared by all layers (index tensors, kernel plans)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,  # [T, KV, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, KV, D] (int8: D + 4)
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        """Write k/v into their slots, then attend every query row over its context."""


def write_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Scatter new K/V rows into the paged cache (shared by backends without a fused op)."""
    block_size = kv_cache.shape[2]
    blocks = slot_mapping // block_size
    rows = slot_mapping % block_size
    kv_cache[blocks, 0, rows] = k.to(kv_cache.dtype)
    kv_cache[blocks, 1, rows] = v.to(kv_cache.dtype)
