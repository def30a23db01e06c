"""What one request can ever hold on the workers of its model."""

from __future__ import annotations

from pdserve.coordinator.registry import WorkerRegistry
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import blocks_for


def too_big(registry: WorkerRegistry, req: m.Generate) -> str | None:
    """Why ``req`` can never run on the workers of its model (prompt plus ``max_tokens``
    beyond the context length or the largest decode worker's whole KV cache), or None."""
    tokens = len(req.prompt_token_ids) + req.sampling.max_tokens
    lengths = [w.info.max_model_len for w in registry.workers.values() if w.info.model == req.model]
    max_len = max(lengths, default=0)
    if max_len and tokens > max_len:
        return (
            f"the prompt ({len(req.prompt_token_ids)} tokens) plus max_tokens "
            f"({req.sampling.max_tokens}) exceeds the model's context length of {max_len} tokens"
        )
    blocks, block_size = registry.decode_capacity(req.model)
    if blocks and blocks_for(tokens, block_size) > blocks:
        return (
            f"the prompt plus max_tokens needs {tokens} tokens of KV cache, more than the "
            f"{blocks * block_size} the largest decode worker holds"
        )
    return None
