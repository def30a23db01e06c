"""What a worker reads of its engine: the KV cache's geometry and use, and the queues' load.

Workers register, heartbeat and move KV through these, never through the scheduler or the
block manager, so either can change inside the engine without a worker noticing.
"""

from __future__ import annotations

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_events import KVEventPublisher
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence


class EngineStatus:
    """The engine's status part: owns nothing, reads the block manager, the KV cache and the
    scheduler's queues for workers (registration, heartbeats, KV transfers)."""

    def __init__(self, blocks: BlockManager, kv_cache: KVCache, scheduler: Scheduler) -> None:
        self._blocks = blocks
        self._kv_cache = kv_cache
        self._scheduler = scheduler

    # ---- the KV cache -----------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Tokens of KV one block holds."""
        return self._blocks.block_size

    @property
    def num_blocks(self) -> int:
        return self._blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._blocks.num_used_blocks

    @property
    def kv_layers(self) -> list[torch.Tensor]:
        """The KV cache, one tensor a layer: what a KV sender reads and a receiver writes."""
        return self._kv_cache.layers

    def kv_event_publisher(self, worker_id: str) -> KVEventPublisher:
        """The ``KVEvents`` of this engine's prefix cache (one publisher an engine: it hooks
        the block manager's store and evict events)."""
        return KVEventPublisher(self._blocks, worker_id)

    # ---- load -------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def queued_prompt_tokens(self) -> int:
        """Tokens still to compute, the load a placement weighs: every waiting sequence's, and
        each running one's but for a one-token decode step (cheap, and not prompt work)."""
        sched = self._scheduler
        waiting = sum(s.num_uncomputed_tokens for s in sched.waiting)
        return waiting + sum(s.num_uncomputed_tokens for s in sched.running if not _decode_step(s))

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (here or reserved into), since start."""
        return self._scheduler.prefix_hit_tokens


def _decode_step(seq: Sequence) -> bool:
    """``seq``'s next computation is one generated token's (as ``LLMEngine.step`` counts it)."""
    return seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
