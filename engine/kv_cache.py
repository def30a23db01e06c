"""Paged KV storage: one tensor per layer, sized from a memory budget.

layers[l]: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (see attention/base.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.config import CacheConfig, ConfigError, ModelConfig

DEFAULT_CPU_KV_BYTES = 256 * 2**20


@dataclass
class KVCache:
    layers: list[torch.Tensor]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[0]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block ``dst[i]`` of every layer becomes a copy of block ``src[i]`` (K and V)."""
        if not src:
            return
        device = self.layers[0].device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=device)
        for layer in self.layers:  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
            layer[dst_t] = layer[src_t]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    @classmethod
    def num_blocks_for(
        cls, cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
    ) -> int:
        """``num_blocks`` if set; else the ``kv_cache_memory`` budget; else, on CUDA, the
        share of free memory left under ``gpu_memory_utilization``; else 256 MiB on CPU."""
        if cache.num_blocks is not None:
            return cache.num_blocks
        per_block = cls.bytes_per_block(cfg, cache.block_size, dtype)
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = free - int(total * (1.0 - cache.gpu_memory_utilization))
        else:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"KV cache budget of {budget} bytes holds no block of {per_block} bytes; "
                "raise --kv-cache-memory or --gpu-memory-utilization"
            )
        return num_blocks

    @classmethod
    def create(
        cls, cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        n = cls.num_blocks_for(cfg, cache, dtype, device)
        shape = (n, 2, cache.block_size, cfg.num_kv_heads, cfg.head_dim)
        layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        return cls(layers, cache.block_size)
