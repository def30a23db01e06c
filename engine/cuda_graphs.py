"""CUDA graphs for decode-only steps, one per batch-size bucket, captured at start.

A decode step of ``n`` sequences replays the graph of the smallest bucket ``B >= n``::

    rows 0..n-1   the real sequences (token, position, slot copied into static buffers)
    rows n..B-1   padding: token 0 at position 0, context of one token at ``pad_slot``, a slot
                  no real row writes this step; its K/V write is masked (old value kept)

Before each replay the attention backend plans the bucket's wrapper on the host (outside the
graph); the replay itself launches the whole forward at once. Steps with a prefill chunk, more
rows than the largest bucket, or ``enforce_eager`` run eagerly.

The bucket and padding choices are plain functions (tested on CPU); ``CudaGraphRunner`` has
NOT yet been run on a GPU (``bench/micro/gpu.py`` measures the decode step on hardware).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.attention.flashinfer_backend import (
    FlashInferBackend,
    GraphShape,
    GraphState,
    paged_kv_indices_from,
)
from pdserve.engine.model import Attention
from pdserve.protocol.blocks import blocks_for

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.model import CausalLM
    from pdserve.engine.model_runner import StepInputs

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, ... below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None when none does."""
    return next((s for s in sorted(sizes) if s >= num_seqs), None)


def decode_slots(seq_lens: list[int], block_tables: list[list[int]], block_size: int) -> list[int]:
    """Slot of each decode row's new token: the last position of its context."""
    return [
        table[(n - 1) // block_size] * block_size + (n - 1) % block_size
        for n, table in zip(seq_lens, block_tables, strict=True)
    ]


def pad_slot(real_slots: list[int]) -> int:
    """The smallest slot no real row writes (padding rows write there, value unchanged)."""
    taken = set(real_slots)
    return next(s for s in range(len(taken) + 1) if s not in taken)


@dataclass(frozen=True)
class PaddedDecode:
    seq_lens: list[int]  # [bucket]
    block_tables: list[list[int]]  # [bucket][pages]
    pad_slot: int
    num_real: int


def pad_decode(
    seq_lens: list[int], block_tables: list[list[int]], block_size: int, bucket: int
) -> PaddedDecode:
    """Host lists of a decode step padded to ``bucket`` rows (see the module docstring)."""
    n = len(seq_lens)
    if n > bucket:
        raise ValueError(f"{n} rows do not fit a bucket of {bucket}")
    slot = pad_slot(decode_slots(seq_lens, block_tables, block_size))
    pad_len, pad_table = slot % block_size + 1, [slot // block_size]
    pages = [blocks_for(s, block_size) for s in seq_lens]
    tables = [list(t[:p]) for t, p in zip(block_tables, pages, strict=True)]
    return PaddedDecode(
        seq_lens=[*seq_lens, *[pad_len] * (bucket - n)],
        block_tables=[*tables, *[pad_table] * (bucket - n)],
        pad_slot=slot,
        num_real=n,
    )


def graphs_unusable_reason(
    config: EngineConfig, backend: AttentionBackend, dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why decode steps run eagerly here, or None when graphs can be captured."""
    if config.enforce_eager:
        return "enforce_eager is set"
    if not getattr(backend, "supports_cuda_graphs", False):
        return f"the {backend.name} attention backend cannot be captured"
    # the ignore: duck-typed, as is supports_cuda_graphs above (flashinfer's, or a test's)
    if not backend.kernel_supports(dtype, head_dim):  # type: ignore[attr-defined]
        return f"{backend.name} has no kernel for {dtype} with head size {head_dim}"
    return None


class CudaGraphRunner:
    """Decode steps padded to buckets; ``run`` replaces ``plan`` + ``model(...)`` for them.

    ``capture=False`` pads without capturing (each step runs the padded batch eagerly): the
    CPU tests drive it that way, and it separates padding bugs from capture bugs on a GPU.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[torch.Tensor],
        backend: AttentionBackend,
        model_config: ModelConfig,
        sizes: list[int],
        max_blocks_per_seq: int,
        capture: bool = True,
    ) -> None:
        if not isinstance(backend, FlashInferBackend):  # the one backend with graph wrappers
            raise TypeError(f"CUDA graphs need the flashinfer backend, not {backend.name}")
        self.model, self.kv_layers, self.backend = model, kv_layers, backend
        self.sizes = sorted(sizes)
        self.block_size = kv_layers[0].shape[2]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.capture = capture
        attn = model.layers[0].self_attn
        if not isinstance(attn, Attention):
            raise TypeError(f"expected the model's Attention layer, got {type(attn).__name__}")
        dtype = kv_layers[0].dtype
        self.shape: GraphShape = (
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            dtype,
            attn.scale,
        )
        self.group = model_config.num_heads // model_config.num_kv_heads
        self._states: dict[int, GraphState] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        dev = kv_layers[0].device
        with torch.inference_mode():
            self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=dev)
            self.positions = torch.zeros(self.sizes[-1], dtype=torch.long, device=dev)

    @torch.inference_mode()
    def setup(self) -> None:
        """A backend state per bucket; captured largest first, in one memory pool (smaller
        graphs reuse the largest one's memory)."""
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        for b in reversed(self.sizes):
            pages = b * self.max_blocks_per_seq
            state = self._states[b] = self.backend.graph_state(b, pages, self.group)
            if not self.capture:
                continue
            self._prepare(state, pad_decode([], [], self.block_size, b), b)  # all padding
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside capture (kernel selection, JIT)
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            self._graphs[b] = (graph, out)
        if self.capture:
            torch.cuda.synchronize()

    def can_run(self, metadata: AttentionMetadata) -> bool:
        return (
            metadata.num_seqs <= self.sizes[-1]
            and all(n == 1 for n in metadata.query_lens_cpu)
            and max(metadata.seq_lens_cpu) <= self.max_blocks_per_seq * self.block_size
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:  # [num_seqs, E]
        meta = inputs.metadata
        n = meta.num_seqs
        b = bucket_for(n, self.sizes)
        assert b is not None, "can_run() was not checked"
        state = self._states[b]
        padded = pad_decode(meta.seq_lens_cpu, meta.block_tables_cpu, self.block_size, b)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        state.slot_mapping[:n].copy_(meta.slot_mapping)
        self._prepare(state, padded, b)
        if b in self._graphs:
            graph, out = self._graphs[b]
            graph.replay()
        else:
            out = self._forward(b)
        return out[:n]

    def _prepare(self, state: GraphState, padded: PaddedDecode, b: int) -> None:
        """Fill the padding rows of the static inputs and plan the bucket's wrapper."""
        n = padded.num_real
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        state.slot_mapping[n:].fill_(padded.pad_slot)
        state.valid[:n].fill_(True)
        state.valid[n:].fill_(False)
        indices = paged_kv_indices_from(
            [1] * b, padded.seq_lens, padded.block_tables, self.block_size
        )
        self.backend.plan_graph(state, indices, self.shape, self.block_size)

    def _forward(self, b: int) -> torch.Tensor:
        hidden: torch.Tensor = self.model(
            self.input_ids[:b], self.positions[:b], self.kv_layers, self.backend
        )
        return hidden


def maybe_capture(
    model: CausalLM,
    kv_layers: list[torch.Tensor],
    backend: AttentionBackend,
    model_config: ModelConfig,
    config: EngineConfig,
    max_model_len: int,
) -> CudaGraphRunner | None:
    """Captured decode graphs for this runner, or None (and the reason logged)."""
    dtype, head_dim = kv_layers[0].dtype, model_config.head_dim
    reason = graphs_unusable_reason(config, backend, dtype, head_dim)
    if reason is not None:
        logger.info("CUDA graphs off: %s", reason)
        return None
    sizes = capture_sizes(config.scheduler.max_num_seqs)
    max_blocks = blocks_for(max_model_len, kv_layers[0].shape[2])
    runner = CudaGraphRunner(model, kv_layers, backend, model_config, sizes, max_blocks)
    runner.setup()
    logger.info("CUDA graphs captured for decode batch sizes %s", sizes)
    return runner
