"""What a worker reads of its engine: the KV cache's geometry and use, and the queues' load.

Workers register, heartbeat and move KV through these, never through the scheduler or the
block manager, so either can change inside the engine without a worker noticing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.kv_events import KVEventPublisher
from pdserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine


class EngineStatusMixin:
    """Mixed into ``LLMEngine``."""

    # ---- the KV cache -----------------------------------------------------------------------
    @property
    def block_size(self: LLMEngine) -> int:
        """Tokens of KV one block holds."""
        return self.block_manager.block_size

    @property
    def num_blocks(self: LLMEngine) -> int:
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self: LLMEngine) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_used_blocks(self: LLMEngine) -> int:
        return self.block_manager.num_used_blocks

    def blocks_needed(self: LLMEngine, num_tokens: int) -> int:
        """Blocks the KV of ``num_tokens`` tokens fills (the last one maybe partly)."""
        return self.block_manager.blocks_needed(num_tokens)

    @property
    def kv_layers(self: LLMEngine) -> list[torch.Tensor]:
        """The KV cache, one tensor a layer: what a KV sender reads and a receiver writes."""
        return self.runner.kv_cache.layers

    def kv_event_publisher(self: LLMEngine, worker_id: str) -> KVEventPublisher:
        """The ``KVEvents`` of this engine's prefix cache (one publisher an engine: it hooks
        the block manager's store and evict events)."""
        return KVEventPublisher(self.block_manager, worker_id)

    # ---- load -------------------------------------------------------------------------------
    @property
    def num_running(self: LLMEngine) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self: LLMEngine) -> int:
        return len(self.scheduler.waiting)

    @property
    def queued_prompt_tokens(self: LLMEngine) -> int:
        """Tokens still to compute, the load a placement weighs: every waiting sequence's, and
        each running one's but for a one-token decode step (cheap, and not prompt work)."""
        sched = self.scheduler
        waiting = sum(s.num_uncomputed_tokens for s in sched.waiting)
        return waiting + sum(s.num_uncomputed_tokens for s in sched.running if not _decode_step(s))

    @property
    def prefix_hit_tokens(self: LLMEngine) -> int:
        """Prompt tokens served from the prefix cache (here or reserved into), since start."""
        return self.scheduler.prefix_hit_tokens


def _decode_step(seq: Sequence) -> bool:
    """``seq``'s next computation is one generated token's (as ``LLMEngine.step`` counts it)."""
    return seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0
