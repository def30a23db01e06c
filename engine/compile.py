"""``--compile``: CPU decode steps through torch.compile (inductor). Off by default.

Only a step of decode rows alone (every sequence one new token, all in one attention group)
runs compiled; prefill chunks and mixed steps run eagerly. The whole model is one graph:
inductor fuses each layer's norms, rope, residual adds, SiLU and KV write into a few C++
loops, while the oneDNN linear layers and the attention ``bmm`` stay library calls::

    eager     prepare ─ backend.plan ─ model(ids, positions, caches, backend)     ~25 ops a layer
    compiled  prepare ─ backend.plan ─ decode_step() ─ graph(ids, positions, caches,
                                                             slots, gather index, bias)

The graph takes the step's plan as tensors only (no Python state to guard on), with dynamic
shapes: one graph for batch 1, one for every larger batch and any context length. Both are
built at start-up (``warm_up``), minutes on a small CPU (see the log line and the README).

Settings: ``freezing`` makes the weights constants, which inductor's oneDNN linear lowering
requires (our packed weights, engine/cpu_linear.py); ``cpp_wrapper`` runs the graph from C++
rather than a Python wrapper of ~600 calls. Needs a C++ compiler (inductor's CPU backend).
Quantized layers (engine/quant/linear.py) stay calls of their C kernel, as the custom op
``pdserve::qlinear``.
"""

from __future__ import annotations

import logging
import shutil

import torch
from torch._inductor import config as inductor_config
from torch.fx.experimental import _config as shape_config

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.attention.torch_ops import KVSlots, decode_attention, write_kv_slots
from pdserve.engine.config import ConfigError
from pdserve.engine.model import CausalLM

logger = logging.getLogger(__name__)

INDUCTOR_SETTINGS = {"freezing": True, "cpp_wrapper": True}
# use_duck_shape=False: sizes that happen to be equal while tracing (the block size and a
# context length, 2 K/V planes and a storage offset) must not become one symbol.


class PlannedDecode(AttentionBackend):
    """A decode-only step's attention from tensors alone (what the compiled graph sees)."""

    name = "torch"
    strided_inputs = True

    def __init__(self, slots: KVSlots, index: torch.Tensor, bias: torch.Tensor) -> None:
        self.slots, self.index, self.bias = slots, index, bias

    def plan(self, metadata: AttentionMetadata) -> None:
        raise RuntimeError("PlannedDecode is planned when built")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        write_kv_slots(kv_cache, self.slots, k, v)
        return decode_attention(q, kv_cache, self.index, self.bias, scale)


class CompiledDecode:
    def __init__(self, model: CausalLM, kv_layers: list[torch.Tensor]) -> None:
        compiler = shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise ConfigError("--compile needs a C++ compiler (g++) for inductor's CPU kernels")
        self.model = model
        self.kv_layers = kv_layers
        self.heads = model.config.num_kv_heads
        self._graph = torch.compile(self._forward, dynamic=True)

    def _forward(
        self,
        input_ids: torch.Tensor,  # [B]
        positions: torch.Tensor,  # [B]
        kv_layers: list[torch.Tensor],
        blocks: torch.Tensor,  # [B]: KVSlots, unpacked
        offsets: torch.Tensor,
        k_sel: torch.Tensor,
        v_sel: torch.Tensor,
        index: torch.Tensor,  # [2 * B * KV * L]
        bias: torch.Tensor,  # [B * KV, 1, L]
    ) -> torch.Tensor:  # [B, E]
        backend = PlannedDecode(KVSlots(blocks, offsets, k_sel, v_sel), index, bias)
        return self.model.hidden_states(input_ids, positions, kv_layers, backend)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor | None:
        """The step's hidden states [B, E] through the graph, or None when the planned step
        is not decode-only (the caller runs it eagerly)."""
        if not isinstance(backend, TorchAttentionBackend):
            return None
        step = backend.decode_step(self.heads)
        if step is None:
            return None
        s, index, bias = step
        # Traced and run under no_grad: inference mode made the graph's view of the cache fail.
        # Settings are patched in around each call (~30 us), not passed as options: dynamo
        # reads ``freezing`` itself, to keep the weights out of the graph's inputs. The ignore:
        # torch adds ``patch`` to its config modules at run time, and declares it for the
        # type checker in inductor's config but not in fx's.
        with (
            torch.inference_mode(False),
            torch.no_grad(),
            inductor_config.patch(INDUCTOR_SETTINGS),
            shape_config.patch(use_duck_shape=False),  # type: ignore[attr-defined]
        ):
            return self._graph(
                input_ids,
                positions,
                self.kv_layers,
                s.blocks,
                s.offsets,
                s.k_sel,
                s.v_sel,
                index,
                bias,
            )
