"""The repository's decoder (engine/model.py) as a token encoder: its final hidden states,
after the final norm, for a packed batch of inputs, keeping no KV.

Each input attends causally over its own tokens (``NoCacheAttention``: the K/V a layer makes
are used once and dropped, no cache is allocated). Qwen3-Embedding and its kin ship a
decoder checkpoint without the ``model.`` prefix and without an output head; both are taken.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.loader import empty_model, iter_weights, safetensors_files
from pdserve.engine.model import CausalLM


class NoCacheAttention(AttentionBackend):
    """Causal attention of each input over its own new tokens; the KV cache argument is
    ignored (the model passes one per layer; empty tensors do)."""

    name = "embed-no-kv"
    strided_inputs = True

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []

    def plan(self, metadata: AttentionMetadata) -> None:
        ends = torch.tensor(metadata.query_lens_cpu).cumsum(0).tolist()
        self._spans = [(e - n, e) for n, e in zip(metadata.query_lens_cpu, ends, strict=True)]

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,  # [T, KV, D]
        kv_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for start, end in self._spans:
            o = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),  # [H, L, D]
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = o.transpose(0, 1)
        return out


class DecoderEncoder:
    """``states(ids, lengths)``: a ``CausalLM``'s final hidden states of a packed batch."""

    def __init__(self, model: CausalLM, max_positions: int) -> None:
        self.model = model
        self.max_positions = max_positions
        self.hidden_size = model.config.hidden_size
        self.vocab_size = model.config.vocab_size
        self._backend = NoCacheAttention()
        self._no_kv = [torch.empty(0) for _ in range(model.config.num_layers)]

    @torch.inference_mode()
    def states(self, ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """ids [T] (the inputs one after another) → [T, E]."""
        lens = list(lengths)
        self._backend.plan(
            AttentionMetadata(
                slot_mapping=torch.empty(0, dtype=torch.long),
                query_lens_cpu=lens,
                seq_lens_cpu=lens,
                block_tables_cpu=[[] for _ in lens],
                block_size=1,
            )
        )
        positions = torch.cat([torch.arange(n) for n in lens])
        return self.model.hidden_states(ids, positions, self._no_kv, self._backend)


def decoder_config(path: Path) -> ModelConfig:
    """config.json as a ``ModelConfig``; a bare ``LlamaModel``/``Qwen2Model``/... architecture
    (an embedding checkpoint saved without its head) read as its ``...ForCausalLM``."""
    raw = json.loads((path / "config.json").read_text())
    given = list(raw.get("architectures") or [])
    heads = [a.removesuffix("Model") + "ForCausalLM" for a in given if a.endswith("Model")]
    raw["architectures"] = given + heads
    return ModelConfig.from_dict(raw, source=str(path / "config.json"))


def load_decoder(path: Path, max_positions: int) -> DecoderEncoder:
    """``path``'s decoder in float32 on CPU, no output head (tied, so none is built: a
    checkpoint's ``lm_head.weight`` is skipped), rotary table for ``max_positions``."""
    cfg = replace(decoder_config(path), tie_word_embeddings=True)
    model = empty_model(cfg, max_positions, torch.float32, "cpu")
    model.load_weights(_model_prefixed(iter_weights(safetensors_files(path))))
    return DecoderEncoder(model.eval(), max_positions)


def _model_prefixed(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Names as a ``...ForCausalLM`` checkpoint has them: ``model.`` before all but the head."""
    for name, tensor in weights:
        keep = name.startswith(("model.", "lm_head."))
        yield (name if keep else f"model.{name}"), tensor
