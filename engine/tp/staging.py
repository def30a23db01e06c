"""KV crossing a tensor-parallel group's edge: the heads of its ranks, whole on rank 0.

Each rank's cache holds its KV heads under block ids the group shares. A transfer moves whole
blocks (every head): rank 0 keeps a staging area of full-head blocks, the only memory the KV
transports see (``EngineStatus.kv_layers``), so a group of A ranks hands KV to one of B ranks
for any A and B, replicated heads included, with the transports' checksums, deadlines and
policies as they are::

    prefill group (A ranks)                            decode group (B ranks)
    export(ids): GATHER_KV, each rank's heads of ids    take(n) staging blocks, the receiver
      ──▶ rank 0's staging blocks, whole                 writes them; on DONE import_(...):
    sender reads staging ──────── wire (full heads) ──▶ SCATTER_KV, each rank gets its heads
                                                          into the reserved block ids

The re-split happens at the two leaders (gathered, then scattered, over the groups' own
collectives), not rank to rank across the wire: each wire transfer is one, as at TP 1.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from pdserve.engine.block_manager import NoFreeBlocks
from pdserve.engine.tp import shm
from pdserve.engine.tp.group import Command, TPGroup
from pdserve.engine.tp.layout import TPLayout


def _ids(block_ids: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.long)


def gather_heads(
    group: TPGroup, layers: list[torch.Tensor], block_ids: torch.Tensor
) -> list[torch.Tensor] | None:
    """Every rank's heads of ``block_ids``: [L, n, 2, bs, KV_rank, D] from each, on rank 0."""
    index = block_ids.to(layers[0].device)
    local = torch.stack([layer.index_select(0, index) for layer in layers])
    return group.gather(local)


Place = Callable[[list[torch.Tensor], torch.Tensor, int], None]


def gather_heads_shm(
    group: TPGroup,
    layers: list[torch.Tensor],
    block_ids: torch.Tensor,
    place: Place | None = None,
) -> bool:
    """``gather_heads`` through shared memory, each rank's blocks written straight into its
    slot and ``place(slots, ids, start)`` (rank 0) taking them from there, a slot's worth of
    blocks at a time; False (nothing done) where the group has no shared memory or one block
    of every layer overflows a slot. Every rank reaches the same answer."""
    channel, first = group.shm, layers[0]
    per_block = len(layers) * first[0].numel() * first.element_size()
    if channel is None or per_block > shm.SLOT_BYTES:
        return False
    step = shm.SLOT_BYTES // per_block
    for start in range(0, block_ids.numel(), step):
        ids = block_ids[start : start + step]
        n = ids.numel()

        def write(slot: torch.Tensor, ids: torch.Tensor = ids, n: int = n) -> None:
            views = slot.view(first.dtype).view(len(layers), n, *first.shape[1:])
            for view, layer in zip(views, layers, strict=True):
                torch.index_select(layer, 0, ids, out=view)

        def read(slots: list[torch.Tensor], ids: torch.Tensor = ids, at: int = start) -> None:
            if place is not None:
                place(slots, ids, at)

        channel.gather_into(n * per_block, write, read if place is not None else None)
    return True


def scatter_heads(
    group: TPGroup,
    layers: list[torch.Tensor],
    block_ids: torch.Tensor,
    parts: list[torch.Tensor] | None = None,
) -> None:
    """Rank 0's ``parts[r]`` ([L, n, 2, bs, KV_r, D]) into blocks ``block_ids`` of rank r."""
    first = layers[0]
    shape = (len(layers), block_ids.numel(), *first.shape[1:])
    out = torch.empty(shape, dtype=first.dtype, device=first.device)
    group.scatter(parts, out)
    index = block_ids.to(first.device)
    for layer, part in zip(layers, out, strict=True):
        layer.index_copy_(0, index, part)


class KVStaging:
    """Rank 0's full-head blocks for KV entering or leaving the group, and its free list."""

    def __init__(
        self, group: TPGroup, layout: TPLayout, cache_layers: list[torch.Tensor], num_blocks: int
    ) -> None:
        self.group, self.layout = group, layout
        self.cache_layers = cache_layers  # this rank's own heads
        first, cfg = cache_layers[0], layout.cfg
        shape = (num_blocks, 2, first.shape[2], cfg.num_kv_heads, cfg.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=first.dtype, device=first.device) for _ in cache_layers
        ]
        self._free = list(range(num_blocks))
        self._free_lock = threading.Lock()  # taken on the worker's thread, given on any
        # the ranks whose heads make a whole block, each its first copy: (rank, heads)
        kv = cfg.num_kv_heads
        self._owners = sorted({layout.kv_owner(h) for h in range(kv)})

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[0]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` staging blocks; ``NoFreeBlocks`` while transfers in flight hold them."""
        with self._free_lock:
            if n > len(self._free):
                raise NoFreeBlocks(
                    f"{n} staging block(s) needed for a tensor-parallel transfer, "
                    f"{len(self._free)} of {self.num_blocks} free (--tp-staging-blocks)"
                )
            taken, self._free = self._free[:n], self._free[n:]
        return taken

    def give(self, ids: list[int]) -> None:
        with self._free_lock:
            self._free.extend(ids)

    def export(self, block_ids: list[int]) -> list[int]:
        """Staging blocks now holding the whole KV of cache blocks ``block_ids`` (to send)."""
        staged = self.take(len(block_ids))
        ids = _ids(block_ids)
        dst = _ids(staged).to(self.layers[0].device)
        with self.group.lock:
            self.group.command(Command.GATHER_KV, ids)
            if gather_heads_shm(self.group, self.cache_layers, ids, self._place(dst)):
                return staged
            parts = gather_heads(self.group, self.cache_layers, ids)
        if parts is None:
            raise RuntimeError("staging blocks are rank 0's: another rank exported KV")
        for layer_index, layer in enumerate(self.layers):
            whole = torch.cat([parts[r][layer_index] for r in self._owners], dim=3)
            layer.index_copy_(0, dst, whole)
        return staged

    def _place(self, dst: torch.Tensor) -> Place:
        """Where rank 0 puts a slot's worth of gathered blocks: each owner's heads of them
        into staging blocks ``dst[at:]``, straight from the ranks' slots."""
        first = self.cache_layers[0]

        def place(slots: list[torch.Tensor], ids: torch.Tensor, at: int) -> None:
            n, targets = ids.numel(), dst[at : at + ids.numel()]
            for r in self._owners:
                heads = self.layout.kv_heads_of(r)
                part = slots[r].view(first.dtype).view(len(self.layers), n, *first.shape[1:])
                for layer, blocks in zip(self.layers, part, strict=True):
                    layer[:, :, :, heads.start : heads.stop].index_copy_(0, targets, blocks)

        return place

    def import_(self, staged: list[int], block_ids: list[int]) -> None:
        """Each rank's heads of staging blocks ``staged`` into its cache blocks ``block_ids``."""
        src = _ids(staged).to(self.layers[0].device)
        whole = torch.stack([layer.index_select(0, src) for layer in self.layers])
        parts = [
            whole[:, :, :, :, h.start : h.stop]
            for h in map(self.layout.kv_heads_of, range(self.group.size))
        ]
        ids = _ids(block_ids)
        with self.group.lock:
            self.group.command(Command.SCATTER_KV, ids)
            scatter_heads(self.group, self.cache_layers, ids, parts)
