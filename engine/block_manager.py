"""The paged KV cache: the block allocator (``BlockManager``: reference counts, a free list, and
a prefix cache) and the storage its block ids index (``KVCache``: one tensor per layer, sized
from a memory budget)::

    layers[l]: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (see attention/base.py)
    --kv-cache-dtype int8: int8 [..., head_dim + 4], a float32 scale per row (attention/kv_quant.py)
    block b of a sequence's block_table: layers[l][b] for every layer l, K then V

Every full block gets a chained hash ``h_i = H(h_{i-1}, tokens of block i)``, so equal hashes
mean equal prefixes. A request whose leading full blocks hash the same as cached ones shares
those blocks (ref count + 1) instead of recomputing them.

Free list (``FreeBlocks``, left = handed out first)::

    [ freed, never hashed (latest first) | never used (by id) | cached, least recently freed ... ]

A cached block with no references stays findable by its hash until the allocator hands it out
again (LRU eviction). Used blocks = blocks with a reference; free blocks include cached ones.
The never-used blocks are a range, not entries, and a block's reference count and hash live in
flat tables: a cache of a million blocks (a small model's default share of a big host) starts
in milliseconds, where an object and a list entry per block took 2.2 s.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.engine.attention.kv_quant import row_width
from pdserve.engine.config import CacheConfig, ConfigError, ModelConfig
from pdserve.engine.kv_memory import lazily_zeroed, machine_memory, share_budget
from pdserve.protocol.blocks import blocks_for, full_blocks

# the coordinator hashes prompts the same way to route them (coordinator/kv_index.py)
from pdserve.protocol.prefix import block_hashes as block_hashes
from pdserve.protocol.prefix import hash_block as hash_block

if TYPE_CHECKING:
    from pdserve.engine.tp.group import TPGroup


class CacheEvents(Protocol):
    """Where the prefix cache reports its changes (``engine.kv_events.KVEventLog``)."""

    def stored(self, block_hash: int) -> None: ...

    def evicted(self, block_hash: int) -> None: ...


class BlockOwner(Protocol):
    """What the allocator needs of a sequence."""

    block_table: list[int]
    block_hashes: list[int]
    num_committed_blocks: int
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


class FreeBlocks:
    """The free block ids in the order they are handed out (module docstring): a stack of
    blocks freed without a hash, the range of blocks never handed out, and the cached blocks
    in the order they were freed."""

    def __init__(self, num_blocks: int) -> None:
        self._unhashed: OrderedDict[int, None] = OrderedDict()  # leftmost goes first
        self._next_unused = 0  # blocks _next_unused.. num_blocks - 1 were never handed out
        self._num_blocks = num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first

    def __len__(self) -> int:
        unused = self._num_blocks - self._next_unused
        return len(self._unhashed) + unused + len(self._cached)

    def __iter__(self) -> Iterator[int]:
        yield from self._unhashed
        yield from range(self._next_unused, self._num_blocks)
        yield from self._cached

    def __contains__(self, block_id: object) -> bool:
        if block_id in self._unhashed or block_id in self._cached:
            return True
        return isinstance(block_id, int) and self._next_unused <= block_id < self._num_blocks

    def take(self) -> int:
        """The next block to hand out (``KeyError`` when none is free)."""
        if self._unhashed:
            return self._unhashed.popitem(last=False)[0]
        if self._next_unused < self._num_blocks:
            self._next_unused += 1
            return self._next_unused - 1
        return self._cached.popitem(last=False)[0]

    def put(self, block_id: int, cached: bool) -> None:
        """A block whose last reference went: a cached one is evicted last, another first."""
        if cached:
            self._cached[block_id] = None
        else:
            self._unhashed[block_id] = None
            self._unhashed.move_to_end(block_id, last=False)

    def remove(self, block_id: int) -> None:
        """A free cached block referenced again (a prefix hit revives it)."""
        if block_id in self._cached:
            del self._cached[block_id]
        elif block_id in self._unhashed:
            del self._unhashed[block_id]
        else:  # only blocks handed out before are found by id
            raise RuntimeError(f"block {block_id} was never handed out: nothing refers to it")


class NoFreeBlocks(RuntimeError):
    pass


class BlockManager:
    """Owns who holds which block: reference counts, the free list (in eviction order) and the
    prefix cache (block hash -> block id); never the KV itself (``KVCache``)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks  # references to each block id
        self.hash_of: dict[int, int] = {}  # block id -> its hash, for blocks in the cache
        self.free = FreeBlocks(num_blocks)
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.events: CacheEvents | None = None  # told of every hash cached and evicted

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- prefix cache -----------------------------------------------------------------
    def find_cached_prefix(self, seq: BlockOwner) -> list[int]:
        """Block ids of the longest cached run of the sequence's leading full blocks.

        The last token is never counted as cached: its logits must be computed.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = seq.all_token_ids
        return self._cached_run(block_hashes(tokens, self.block_size, seq.block_hashes), tokens)

    def find_cached_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """``find_cached_prefix`` for tokens that have no sequence (yet): a reservation."""
        if not self.enable_prefix_caching:
            return []
        return self._cached_run(block_hashes(token_ids, self.block_size, []), token_ids)

    def _cached_run(self, hashes: list[int], tokens: Sequence[int]) -> list[int]:
        limit = full_blocks(max(len(tokens) - 1, 0), self.block_size)  # never the last token
        hits: list[int] = []
        for h in hashes[:limit]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: BlockOwner, lag: int = 0) -> None:
        """Register the hashes of blocks whose every token now has its KV computed (``lag``:
        of the last computed tokens, how many a draft model has not: engine/spec/draft.py;
        a block is cached once both models' KV is in it)."""
        if not self.enable_prefix_caching:
            return
        num_full = full_blocks(seq.num_computed_tokens - lag, self.block_size)
        if num_full <= seq.num_committed_blocks:
            return
        hashes = block_hashes(seq.all_token_ids, self.block_size, seq.block_hashes)
        for i in range(seq.num_committed_blocks, num_full):
            block_id = seq.block_table[i]
            if block_id not in self.hash_of and hashes[i] not in self.cached:
                self.hash_of[block_id] = hashes[i]
                self.cached[hashes[i]] = block_id
                if self.events is not None:
                    self.events.stored(hashes[i])
        seq.num_committed_blocks = num_full

    # ---- allocation -------------------------------------------------------------------
    def allocate(self, seq: BlockOwner, num_new_tokens: int, hits: Sequence[int] = ()) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens after its computed ones.

        ``hits`` (from ``find_cached_prefix``, only for a sequence with no blocks yet) are
        shared and counted as computed. Returns False, changing nothing, if blocks run out.
        """
        if hits and seq.block_table:
            raise ValueError("prefix hits apply only to a sequence without blocks")
        if self._blocks_to_take(seq, num_new_tokens, hits) > len(self.free):
            return False
        for block_id in hits:
            self._ref(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens += len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        total = seq.num_computed_tokens + num_new_tokens
        for _ in range(self.blocks_needed(total) - len(seq.block_table)):
            seq.block_table.append(self._take_free())
        return True

    def free_seq(self, seq: BlockOwner) -> None:
        """Drop the sequence's references; the tail goes first into the eviction order."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table.clear()
        seq.num_committed_blocks = 0

    def trim(self, seq: BlockOwner, num_tokens: int) -> None:
        """Give back ``seq``'s blocks past those ``num_tokens`` tokens need (drafts rejected
        by a verification: engine/spec/)."""
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._unref(block_id)
        del seq.block_table[keep:]

    def allocate_blocks(self, n: int, hits: Sequence[int] = ()) -> list[int]:
        """``hits`` (cached blocks, from ``find_cached_blocks``) shared, then ``n`` fresh blocks,
        each with one more reference (for reservations outside a sequence)."""
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        if n + revived > len(self.free):
            raise NoFreeBlocks(f"need {n + revived} blocks, {len(self.free)} free")
        for block_id in hits:
            self._ref(block_id)
        return [*hits, *(self._take_free() for _ in range(n))]

    def share(self, block_ids: Sequence[int]) -> None:
        """One more reference to each block (a forked sequence reading the same KV)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} is free: nothing to share")
            self._ref(block_id)

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        for block_id in reversed(block_ids):
            self._unref(block_id)

    # ---- internals --------------------------------------------------------------------
    def _blocks_to_take(self, seq: BlockOwner, num_new_tokens: int, hits: Sequence[int]) -> int:
        total = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        fresh = max(0, self.blocks_needed(total) - len(seq.block_table) - len(hits))
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        return fresh + revived

    def _take_free(self) -> int:
        block_id = self.free.take()
        block_hash = self.hash_of.pop(block_id, None)
        if block_hash is not None:  # evict: the cached content is about to be overwritten
            del self.cached[block_hash]
            if self.events is not None:
                self.events.evicted(block_hash)
        self.ref_counts[block_id] = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            self.free.remove(block_id)
        self.ref_counts[block_id] += 1

    def _unref(self, block_id: int) -> None:
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            self.free.put(block_id, cached=block_id in self.hash_of)


@dataclass
class KVCache:
    """The KV of every block, one tensor per layer (layout in the module docstring)."""

    layers: list[torch.Tensor]
    block_size: int
    # rank 0 of a tensor-parallel group: copies are made on every rank (engine/tp/)
    group: TPGroup | None = None
    # a draft model's KV (speculative decoding: engine/spec/draft.py), the same block ids: its
    # layers follow the target's wherever blocks are copied or moved (``all_layers``)
    draft_layers: list[torch.Tensor] = field(default_factory=list)

    @property
    def all_layers(self) -> list[torch.Tensor]:
        """Every layer a block spans: the target's, then a draft model's."""
        return [*self.layers, *self.draft_layers]

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[0]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block ``dst[i]`` of every layer becomes a copy of block ``src[i]`` (K and V), on
        every rank of a tensor-parallel group."""
        if not src:
            return
        if self.group is None:
            self.copy_local(src, dst)
            return
        from pdserve.engine.tp.group import Command

        with self.group.lock:
            self.group.command(Command.COPY_BLOCKS, torch.tensor(src + dst))
            self.copy_local(src, dst)

    def copy_local(self, src: list[int], dst: list[int]) -> None:
        """``copy_blocks`` in this process's cache alone."""
        device = self.layers[0].device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=device)
        for layer in self.all_layers:  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
            layer[dst_t] = layer[src_t]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.all_layers)

    @staticmethod
    def storage_dtype(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
        """What the layers hold: the model's ``dtype``, or int8 rows with their scales."""
        return torch.int8 if kv_cache_dtype == "int8" else dtype

    @classmethod
    def bytes_per_block(
        cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        itemsize = cls.storage_dtype(dtype, kv_cache_dtype).itemsize
        width = row_width(cfg.head_dim, kv_cache_dtype)
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * width * itemsize

    @classmethod
    def num_blocks_for(
        cls,
        cfg: ModelConfig,
        cache: CacheConfig,
        dtype: torch.dtype,
        device: torch.device,
        draft: ModelConfig | None = None,
    ) -> int:
        """``num_blocks`` if set; else the ``kv_cache_memory`` budget; else, on CUDA, the
        share of free memory left under ``gpu_memory_utilization``; else, on CPU, the
        ``cpu_memory_share`` of the machine's memory (engine/kv_memory.py). A ``draft``
        model's KV shares the budget: a block holds both."""
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = cls.bytes_per_block(cfg, cache.block_size, dtype, cache.kv_cache_dtype)
        if draft is not None:
            per_block += cls.bytes_per_block(draft, cache.block_size, dtype, cache.kv_cache_dtype)
        budget = cls.budget(cache, device)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
                "raise --kv-cache-memory or --gpu-memory-utilization"
            )
        return num_blocks

    @staticmethod
    def budget(cache: CacheConfig, device: torch.device) -> int:
        """The bytes the cache may take when ``num_blocks`` is not set."""
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            return free - int(total * (1.0 - cache.gpu_memory_utilization))
        return share_budget(cache.cpu_memory_share)

    @staticmethod
    def sized_by(cache: CacheConfig, device: torch.device) -> str:
        """What set the cache's size, in words (the start-up log)."""
        if cache.num_blocks is not None:
            return "--num-kv-blocks"
        if cache.kv_cache_memory is not None:
            return "--kv-cache-memory"
        if device.type == "cuda":
            return f"--gpu-memory-utilization {cache.gpu_memory_utilization}"
        gib = machine_memory() / 2**30
        return f"{cache.cpu_memory_share:.0%} of this machine's {gib:.1f} GiB (--kv-cache-share)"

    @classmethod
    def create(
        cls,
        cfg: ModelConfig,
        cache: CacheConfig,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int | None = None,
        draft: ModelConfig | None = None,
    ) -> KVCache:
        """``cfg``'s cache of ``num_blocks`` blocks (default: as ``num_blocks_for`` sizes it,
        leaving a ``draft`` model's KV its share)."""
        if cache.kv_cache_dtype == "int8" and device.type != "cpu":
            # flashinfer, CUDA graphs and the GPU transports read the model's dtype only
            raise ConfigError(f"int8 KV cache is CPU-only for now (device {device})")
        n = num_blocks or cls.num_blocks_for(cfg, cache, dtype, device, draft)
        width = row_width(cfg.head_dim, cache.kv_cache_dtype)
        shape = (n, 2, cache.block_size, cfg.num_kv_heads, width)
        kv_dtype = cls.storage_dtype(dtype, cache.kv_cache_dtype)
        if device.type == "cpu":  # zero pages, taken as blocks are first written
            layers = [lazily_zeroed(shape, kv_dtype) for _ in range(cfg.num_layers)]
        else:
            layers = [
                torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(cfg.num_layers)
            ]
        return cls(layers, cache.block_size)
