"""A ``CausalLM`` whose linear layers are a GGUF file's quantized tensors, kept as they are.

    GGUF (llama.cpp names)                  CausalLM
    blk.i.attn_q | attn_k | attn_v    ──▶   layers[i].self_attn.qkv_proj   one QuantLinear,
    blk.i.attn_output                 ──▶   layers[i].self_attn.o_proj     rows concatenated
    blk.i.ffn_gate | ffn_up           ──▶   layers[i].mlp.gate_up_proj     (one QuantLinear)
    blk.i.ffn_down                    ──▶   layers[i].mlp.down_proj
    output (untied)                   ──▶   lm_head
    token_embd                        ──▶   embed_tokens (dequantized: a float lookup) and,
                                            tied, tied_head (a QuantLinear of its blocks)
    norms (F32)                       ──▶   RMSNorm weights, float

A linear layer whose parts are not all quantized alike (a float part, or Q8_0 beside Q4_1 in
one fused layer) is loaded as a float nn.Linear, and says so in the log.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.meta_init import on_meta
from pdserve.engine.model import CausalLM
from pdserve.engine.quant.gguf_weights import (
    QUANTIZED,
    concat_rows,
    dequantize_into,
    float_tensor,
    quant_weight,
    type_name,
)
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.weights import QuantWeight
from pdserve.models.gguf import GGUFFile
from pdserve.models.gguf_convert import hf_name, rotary_heads
from pdserve.models.store import quantization_label

if TYPE_CHECKING:
    from pdserve.engine.tp.layout import TPLayout

logger = logging.getLogger(__name__)

# (the module holding it, its attribute, the GGUF tensors fused into it, in row order)
_LAYER_LINEARS = (
    ("self_attn", "qkv_proj", ("attn_q", "attn_k", "attn_v")),
    ("self_attn", "o_proj", ("attn_output",)),
    ("mlp", "gate_up_proj", ("ffn_gate", "ffn_up")),
    ("mlp", "down_proj", ("ffn_down",)),
)
EMBEDDING = "token_embd.weight"


def load_gguf_kept(
    path: Path,
    cfg: ModelConfig,
    positions: int,
    dtype: torch.dtype,
    device: str | torch.device,
    layout: TPLayout | None = None,
) -> CausalLM | None:
    """The model in GGUF ``path`` with its quantized tensors kept; None where it has none
    (a float GGUF: load it as float). ValueError names a missing or misplaced tensor.
    ``layout``: a tensor-parallel rank's part, each quantized tensor's rows or block columns
    read alone."""
    from pdserve.engine.loader import materialise, rank_model

    with GGUFFile(path, strings=False) as f:
        label = quantization_label(f.type_counts())
        if label == "none":
            return None
        with on_meta():
            model = rank_model(cfg, positions, layout)
        slots = list(_linear_slots(model, cfg))
        for owner, attr, _ in slots:
            setattr(owner, attr, None)  # no float storage for what the GGUF keeps quantized
        model = materialise(model, cfg, positions, dtype, device)
        builder = _Builder(f, cfg, dtype, torch.device(device), layout)
        taken = {name for _, _, names in slots for name in names}
        missing = sorted(taken - f.tensors.keys())
        if missing:
            raise ValueError(f"missing tensor(s) {', '.join(missing[:5])}")
        model.load_weights(builder.floats(taken, model.embed_tokens.weight.data))
        for owner, attr, names in slots:
            setattr(owner, attr, builder.linear(names))
        if cfg.tie_word_embeddings and builder.embedding is not None:
            head = builder.embedding
            if len(model.vocab) != cfg.vocab_size:  # a tensor-parallel rank's rows
                head = slice_rows(head, model.vocab.start, model.vocab.stop)
            model.tied_head = builder.quant_linear(head)
    model.quantization = label
    logger.info("%s: %s kept quantized (%.1f MiB)", path, label, _quant_bytes(model) / 2**20)
    return model


Slot = tuple[nn.Module, str, tuple[str, ...]]  # a module, its attribute, the GGUF tensors


def _linear_slots(model: CausalLM, cfg: ModelConfig) -> Iterator[Slot]:
    """(module, attribute, GGUF tensor names) for every linear layer the GGUF fills."""
    for i, layer in enumerate(model.layers):
        for part, attr, names in _LAYER_LINEARS:
            yield getattr(layer, part), attr, tuple(f"blk.{i}.{n}.weight" for n in names)
    if not cfg.tie_word_embeddings:
        yield model, "lm_head", ("output.weight",)


class _Builder:
    """Turns one GGUF file's tensors into this model's layers (on ``device``, float parts in
    ``dtype``); keeps the embedding's blocks for a tied head."""

    def __init__(
        self,
        f: GGUFFile,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        layout: TPLayout | None,
    ) -> None:
        self.f, self.cfg, self.dtype, self.device = f, cfg, dtype, device
        self.layout = layout
        self.embedding: QuantWeight | None = None

    def _part(self, name: str) -> tuple[int, int, int] | None:
        """The part of GGUF tensor ``name`` a tensor-parallel rank keeps (None: all)."""
        hf = hf_name(name)
        return None if self.layout is None or hf is None else self.layout.slice_of(hf)

    def floats(self, taken: set[str], embed: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor not in a linear layer, float, under its Hugging Face name; a quantized
        embedding is dequantized straight into ``embed`` (the model's table) and given as it."""
        for name, t in self.f.tensors.items():
            if name in taken:
                continue
            out_name = hf_name(name)
            if out_name is None:
                raise ValueError(f"tensor {name} has no place in a Llama model")
            if name == EMBEDDING and t.type in QUANTIZED:
                self.embedding = quant_weight(self.f, name)
                dequantize_into(self.embedding, embed)  # bit-exact to the GGUF's own
                yield out_name, embed  # copied onto itself: nothing moves
            else:
                w = float_tensor(self.f, name)
                part = self._part(name)
                yield out_name, w if part is None else w.narrow(part[0], part[1], part[2] - part[1])

    def linear(self, names: tuple[str, ...]) -> nn.Module:
        """One layer of the tensors ``names`` (rows concatenated): quantized where they all
        are, alike; else float."""
        heads = [rotary_heads(n, self.cfg.num_heads, self.cfg.num_kv_heads) for n in names]
        cuts = [self._part(n) for n in names]
        types = [self.f.tensors[n].type for n in names]
        if all(t in QUANTIZED for t in types):
            parts = [
                quant_weight(self.f, n, _heads_read(h, cut, self.cfg.head_dim), cut)
                for n, h, cut in zip(names, heads, cuts, strict=True)
            ]
            if len({(p.kind, p.group) for p in parts}) == 1:
                return self.quant_linear(concat_rows(parts))
        if any(t in QUANTIZED for t in types):
            kinds = ", ".join(f"{n} {type_name(t)}" for n, t in zip(names, types, strict=True))
            logger.info("%s: one layer of unlike tensors (%s) loaded as float", self.f.path, kinds)
        floats = [float_tensor(self.f, n, h) for n, h in zip(names, heads, strict=True)]
        w = torch.cat(
            [
                t if cut is None else t.narrow(cut[0], cut[1], cut[2] - cut[1])
                for t, cut in zip(floats, cuts, strict=True)
            ]
        )
        layer = nn.Linear(w.shape[1], w.shape[0], bias=False, device=self.device, dtype=self.dtype)
        layer.weight.data.copy_(w)
        return layer

    def quant_linear(self, w: QuantWeight) -> QuantLinear:
        if w.data.device != self.device:
            w = dataclasses.replace(
                w,
                data=w.data.to(self.device),
                scales=w.scales.to(self.device),
                mins=None if w.mins is None else w.mins.to(self.device),
            )
        return QuantLinear(w, None)


def _heads_read(heads: int | None, cut: tuple[int, int, int] | None, head_dim: int) -> int | None:
    """The rotary heads among the rows a rank reads (whole heads: engine/tp/layout.py)."""
    if heads is None or cut is None or cut[0] != 0:
        return heads
    return (cut[2] - cut[1]) // head_dim


def slice_rows(w: QuantWeight, start: int, stop: int) -> QuantWeight:
    """Rows [start, stop) of ``w`` (a tensor-parallel rank's vocabulary of a tied head)."""
    return dataclasses.replace(
        w,
        data=w.data[start:stop].contiguous(),
        scales=w.scales[start:stop].contiguous(),
        mins=None if w.mins is None else w.mins[start:stop].contiguous(),
    )


def _quant_bytes(model: CausalLM) -> int:
    return sum(int(getattr(m, "weight_bytes", 0)) for m in model.modules() if m is not model)
