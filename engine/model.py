"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat, ragged token batch.

Shapes: T = tokens in the step, H/KV = query/key-value heads, D = head_dim, E = hidden size.
Q/K/V and gate/up projections are fused at load time (one matmul each). A module's call is
typed Any by torch (``nn.Module.__call__``): its result is given its type where it is returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.config import ModelConfig
from pdserve.engine.cpu_norm import add_rms_norm
from pdserve.engine.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of ``x``; with ``residual``, of ``x += residual`` (x updated in place)."""
        if x.dtype == torch.float32:  # one C call on CPU (engine/cpu_norm.py), else torch's
            return add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x += residual
        # computed in float32, as transformers does, whatever the model dtype
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qk_v_heads = (cfg.num_heads + cfg.num_kv_heads, cfg.num_kv_heads)
        self.q_k_heads = (cfg.num_heads, cfg.num_kv_heads)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5
        # a tensor-parallel rank's sum of every rank's o_proj output (engine/tp/), in place
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self.native_rope = True  # one C call on CPU float32 (CausalLM.use_native_rope)

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin_signed: [T, 1, D]
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, -1, self.head_dim)  # [T, H + 2 * KV, D]
        # views, strided when T > 1 (split_with_sizes: one op where slicing took seven, ~5 us)
        qk, v = qkv.split_with_sizes(self.qk_v_heads, dim=1)  # [T, H + KV, D], [T, KV, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split_with_sizes(self.q_k_heads, dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # query and key heads at once; on CPU float32 in place, in qkv (or cat's output)
        qk = apply_rotary(qk, *rope, native=self.native_rope)
        q, k = qk.split_with_sizes(self.q_k_heads, dim=1)  # [T, H, D], [T, KV, D]
        if not backend.strided_inputs:
            q, k = q.contiguous(), k.contiguous()
        out = backend.forward(q, k, v, kv_cache, self.scale)  # [T, H, D]
        projected: torch.Tensor = self.o_proj(out.reshape(t, -1))  # [T, E]
        if self.reduce is not None:
            self.reduce(projected)
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], None] | None = None  # as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        if self.reduce is not None:
            self.reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        pending: torch.Tensor | None,
    ) -> torch.Tensor:
        """The MLP's output, still to be added to ``x`` (the next norm adds it, fused).

        x is this step's own tensor (the embedding lookup's output): residuals add in place;
        ``pending`` is the previous layer's MLP output (None for the first layer)."""
        attn = self.self_attn(self.input_layernorm(x, pending), rope, kv_cache, backend)
        out: torch.Tensor = self.mlp(self.post_attention_layernorm(x, attn))
        return out


class CausalLM(nn.Module):
    """``vocab``: the rows of the output head this model computes (a tensor-parallel rank's
    slice; all of them by default); ``gather_vocab`` then makes the whole logits of them."""

    def __init__(self, cfg: ModelConfig, max_positions: int, vocab: range | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.vocab = vocab or range(cfg.vocab_size)
        self.gather_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, len(self.vocab), bias=False)
        self.tied_head: nn.Module | None = None  # a packed or quantized copy of the tied embedding
        # the linear layers' weight form: "none" (float), "int8", "int4-g32", "gguf Q4_1+Q8_0"
        self.quantization = "none"

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, E]
        return self.hidden_states(input_ids, positions, kv_caches, backend)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """``forward`` under the caller's grad mode: torch.compile traces this one under
        ``no_grad`` (inference mode made its view of the KV cache fail; engine/compile.py)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        pending = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            pending = layer(x, rope, kv_cache, backend, pending)
        hidden: torch.Tensor = self.norm(x, pending)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V] float32
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(hidden)
        elif self.tied_head is not None:
            logits = self.tied_head(hidden)
        else:
            logits = F.linear(hidden, self.head_weight())
        if self.gather_vocab is not None:
            logits = self.gather_vocab(logits)
        return logits.float()

    def use_native_rope(self, on: bool) -> None:
        """Rope through engine/cpu_rope.py's C call where it takes the tensors (the default),
        or as torch ops alone (the reference a benchmark compares with; the same bits)."""
        for layer in self.decoder_layers():
            layer.self_attn.native_rope = on

    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers``, typed."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def head_weight(self) -> torch.Tensor:
        """The tied output head's rows (``vocab``'s slice of the embedding: no copy)."""
        weight: torch.Tensor = self.embed_tokens.weight
        if len(self.vocab) == weight.shape[0]:
            return weight
        return weight[self.vocab.start : self.vocab.stop]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Errors name tensors."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue
            if hf_name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints store the copy anyway
            name, shard = _map_name(hf_name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self)}")
            target = param.data if shard is None else _shard_view(param.data, shard, self)
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(hf_name)
        expected = set(_expected_hf_names(self))
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _map_name(hf_name: str) -> tuple[str, tuple[str, int] | None]:
    """HF name -> (our parameter name, (fused kind, index) or None)."""
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, index = _FUSED[part]
            parts[i] = fused
            return ".".join(parts), (part, index)
    return name, None


def _shard_view(param: torch.Tensor, shard: tuple[str, int], model: CausalLM) -> torch.Tensor:
    cfg = model.config
    kind, index = shard
    if kind in ("q_proj", "k_proj", "v_proj"):
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q_size, kv_size, kv_size]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    offset = sum(sizes[:index])
    return param.narrow(0, offset, sizes[index])


def _expected_hf_names(model: CausalLM) -> Iterable[str]:
    unfused = {v[0]: [k for k, (f, _) in _FUSED.items() if f == v[0]] for v in _FUSED.values()}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        prefix = "" if parts[0] == "lm_head" else "model."
        fused = next((p for p in parts if p in unfused), None)
        if fused is None:
            yield prefix + name
            continue
        for hf_part in unfused[fused]:
            yield prefix + name.replace(fused, hf_part)
