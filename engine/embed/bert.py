"""A BERT encoder (transformers' ``BertModel``, no pooler) over a packed batch of inputs.

    ids [T] ──▶ word + token type 0 + absolute position ──▶ LayerNorm
            ──▶ L × [ bidirectional attention (each input over its own tokens) ──▶ + ──▶ LN
                      ──▶ up ──▶ GELU ──▶ down ──▶ + ──▶ LN ]  (post-LayerNorm)
            ──▶ [T, E] last hidden states

Shapes: T = tokens of the batch, E = hidden size, H = heads, D = head size, I = MLP size.
Inputs are packed, not padded: input ``i`` owns rows ``starts[i]:starts[i] + lengths[i]``;
the linear layers see every row at once, attention runs per input. Weights load from a Hugging
Face checkpoint's names, with or without a ``bert.`` prefix (a BertFor... model's heads are left
out); q/k/v are fused into one matmul at load.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.embed.sentence_config import EmbeddingConfigError
from pdserve.engine.loader import iter_weights, safetensors_files
from pdserve.engine.meta_init import on_meta

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": lambda x: F.gelu(x),  # erf, as transformers' "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` the encoder needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config") -> BertConfig:
        kind = cfg.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise EmbeddingConfigError(f"{source}: position_embedding_type {kind!r} unsupported")
        act = cfg.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise EmbeddingConfigError(f"{source}: hidden_act {act!r}; known: {list(ACTIVATIONS)}")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % heads:
            raise EmbeddingConfigError(f"{source}: hidden_size {hidden} not a multiple of {heads}")
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            intermediate_size=int(cfg["intermediate_size"]),
            hidden_act=act,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        )


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        e = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_heads, e // cfg.num_heads
        self.qkv = nn.Linear(e, 3 * e)
        self.attn_out = nn.Linear(e, e)
        self.attn_norm = nn.LayerNorm(e, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(e, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, e)
        self.out_norm = nn.LayerNorm(e, eps=cfg.layer_norm_eps)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
        t, e = x.shape
        qkv = self.qkv(x).view(t, 3, self.heads, self.head_dim)  # [T, 3, H, D]
        attn = torch.empty(t, self.heads, self.head_dim, dtype=x.dtype)  # [T, H, D]
        for start, end in spans:
            q, k, v = qkv[start:end].permute(1, 2, 0, 3)  # each [H, L, D]
            attn[start:end] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
        x = self.attn_norm(self.attn_out(attn.view(t, e)) + x)
        out: torch.Tensor = self.out_norm(self.down(self.act(self.up(x))) + x)
        return out


class BertEncoder(nn.Module):
    """``states(ids, lengths)``: the last hidden states of a packed batch."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        e = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, e)
        self.position = nn.Embedding(cfg.max_position_embeddings, e)
        self.token_type = nn.Embedding(cfg.type_vocab_size, e)
        self.embed_norm = nn.LayerNorm(e, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @torch.inference_mode()
    def states(self, ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """ids [T] (the inputs one after another) → [T, E]."""
        positions = torch.cat([torch.arange(n) for n in lengths])
        # the order transformers adds them in: word + token type, then position
        x: torch.Tensor = self.word(ids) + self.token_type.weight[0]  # [T, E]
        x = self.embed_norm(x + self.position(positions))
        ends = torch.tensor(lengths).cumsum(0).tolist()
        spans = [(end - n, end) for n, end in zip(lengths, ends, strict=True)]
        for layer in self.layers:
            x = layer(x, spans)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in; a missing or misshapen one is a ValueError."""
        params = dict(self.named_parameters())
        e = self.config.hidden_size
        wanted = {f"{n}:{part}" for n in params for part in _parts(n)}
        for hf_name, tensor in weights:
            mapped = _map_name(hf_name)
            if mapped is None:
                continue
            name, part = mapped
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in a BertEncoder")
            target = params[name].data
            if part is not None:
                target = target.narrow(0, part * e, e)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            wanted.discard(f"{name}:{part}")
        if wanted:
            raise ValueError(f"checkpoint is missing {len(wanted)} tensor(s): {sorted(wanted)[:5]}")


# transformers' names (after a "bert." prefix) → ours; q/k/v are parts 0/1/2 of qkv
_NAMES = [
    (r"embeddings\.word_embeddings\.(\w+)", r"word.\1"),
    (r"embeddings\.position_embeddings\.(\w+)", r"position.\1"),
    (r"embeddings\.token_type_embeddings\.(\w+)", r"token_type.\1"),
    (r"embeddings\.LayerNorm\.(\w+)", r"embed_norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(\w+)", r"layers.\1.qkv.\3"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(\w+)", r"layers.\1.attn_out.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(\w+)", r"layers.\1.attn_norm.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(\w+)", r"layers.\1.up.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(\w+)", r"layers.\1.down.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(\w+)", r"layers.\1.out_norm.\2"),
]
_QKV = {"query": 0, "key": 1, "value": 2}
_OLD_NORM = {"gamma": "weight", "beta": "bias"}  # LayerNorm names of TF-era checkpoints


def _map_name(hf_name: str) -> tuple[str, int | None] | None:
    """(our parameter, its q/k/v part or None); None for a tensor the encoder does not use
    (pooler, a task head, the position_ids buffer)."""
    name = hf_name.removeprefix("bert.")
    for pattern, repl in _NAMES:
        m = re.fullmatch(pattern, name)
        if m is None:
            continue
        ours = m.expand(repl)
        stem, _, leaf = ours.rpartition(".")
        ours = f"{stem}.{_OLD_NORM.get(leaf, leaf)}"
        part = _QKV[m.group(2)] if ".qkv." in ours else None
        return ours, part
    if name.startswith(("pooler.", "cls.", "embeddings.position_ids")):
        return None
    return name, None  # unknown: load_weights names it


def _parts(name: str) -> tuple[int | None, ...]:
    return (0, 1, 2) if ".qkv." in name else (None,)


def load_bert(path: Path) -> BertEncoder:
    """``path``'s BERT (config.json, *.safetensors) in float32 on CPU."""
    cfg = BertConfig.from_dict(json.loads((path / "config.json").read_text()), str(path))
    with on_meta():  # no random init: every parameter is loaded below
        encoder = BertEncoder(cfg)
    encoder = encoder.to_empty(device="cpu")
    encoder.load_weights(iter_weights(safetensors_files(path)))
    return encoder.eval()
