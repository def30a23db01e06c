"""A rank's model runner parts: its model wired to the group, its KV cache sized with the
group's, rank 0's staging blocks."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from pdserve.engine.block_manager import KVCache
from pdserve.engine.config import CacheConfig, ConfigError
from pdserve.engine.model import CausalLM
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.layout import TPLayout
from pdserve.engine.tp.staging import KVStaging
from pdserve.protocol.blocks import blocks_for

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner


def wire_model(model: CausalLM, group: TPGroup, layout: TPLayout) -> None:
    """The row-split layers' outputs summed over the group; the logits gathered on rank 0."""
    for layer in model.decoder_layers():
        layer.self_attn.reduce = group.all_reduce
        layer.mlp.reduce = group.all_reduce
    model.gather_vocab = partial(gather_vocab, group, layout)


def gather_vocab(group: TPGroup, layout: TPLayout, logits: torch.Tensor) -> torch.Tensor:
    """Each rank's logits [N, V_rank] of its vocabulary slice -> the whole [N, V] on rank 0
    (the others get theirs back: only rank 0 samples)."""
    if logits.shape[0] == 0:  # every rank has the same rows: none to gather
        return logits.new_empty((0, layout.cfg.vocab_size))
    widest = len(layout.vocab_of(0))
    padded = logits
    if logits.shape[1] < widest:  # the last rank's slice may be shorter
        padded = torch.nn.functional.pad(logits, (0, widest - logits.shape[1]))
    parts = group.gather(padded)
    if parts is None:
        return logits
    return torch.cat([p[:, : len(layout.vocab_of(r))] for r, p in enumerate(parts)], dim=1)


def group_cache(
    group: TPGroup,
    layout: TPLayout,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCache:
    """This rank's heads of every block; as many blocks on every rank (ids are the group's):
    the fewest any rank's budget holds. On a CPU the ranks of a group share the machine's
    budget; on CUDA each has its own device's."""
    local = layout.local_config()
    if cache.num_blocks is not None:
        mine = cache.num_blocks
    else:
        budget = KVCache.budget(cache, device)
        if device.type == "cpu" and cache.kv_cache_memory is None:
            budget //= group.size
        per_block = KVCache.bytes_per_block(local, cache.block_size, dtype, cache.kv_cache_dtype)
        mine = budget // per_block
    num_blocks = group.min_int(mine)
    if num_blocks < 1:
        raise ConfigError(
            "the KV cache budget of a tensor-parallel rank holds no block; raise "
            "--kv-cache-memory or --gpu-memory-utilization"
        )
    kv = KVCache.create(local, cache, dtype, device, num_blocks)
    kv.group = group if group.leads else None  # rank 0 tells the others to copy too
    return kv


def make_staging(runner: ModelRunner) -> KVStaging:
    """Rank 0's staging blocks: ``--tp-staging-blocks``, else room for two whole sequences
    in flight (no more than the cache holds)."""
    group, layout = runner.group, runner.layout
    if group is None or layout is None:
        raise ValueError("staging blocks are for rank 0 of a tensor-parallel group")
    count = runner.config.tp_staging_blocks
    if count <= 0:
        seq_blocks = blocks_for(runner.max_model_len, runner.kv_cache.block_size)
        count = min(runner.kv_cache.num_blocks, 2 * seq_blocks)
    return KVStaging(group, layout, runner.kv_cache.layers, count)
