"""Write a deterministic random checkpoint in exactly the Hugging Face layout.

    out_dir/
      config.json               generation_config.json
      model.safetensors         (or model-0000i-of-0000N.safetensors + model.safetensors.index.json)
      tokenizer.json            tokenizer_config.json        special_tokens_map.json

The tokenizer is a real byte-level BPE trained on ``models/data/corpus.txt``; the weights are
random but fixed by the seed, so transformers and our engine can be compared logit for logit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pdserve.models.make_tokenizer import (
    BOS,
    END_OF_TEXT,
    IM_END,
    TEMPLATES,
    build_tokenizer,
    special_token_ids,
    write_json,
    write_tokenizer_config,
)
from pdserve.models.store import models_dir

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool


PRESETS = {
    "tiny": Preset(64, 128, 2, 4, 2, 16, 2048, tie_word_embeddings=True),
    "small": Preset(512, 1024, 5, 8, 4, 64, 4096, tie_word_embeddings=False),
    # a draft for "tiny" (speculative decoding tests): its KV heads and head size, one layer
    "tiny-draft": Preset(32, 64, 1, 2, 2, 16, 2048, tie_word_embeddings=True),
    # Llama 3.2 1B's shape (its own vocabulary aside): the tensor-parallel benchmark's model
    "llama-1b": Preset(2048, 8192, 16, 32, 8, 64, 8192, tie_word_embeddings=True),
}


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    arch: str = "llama",
    dtype: str = "float32",
    num_shards: int = 1,
    template: str = "hermes",
) -> Path:
    """Write a model directory that transformers loads unmodified; returns ``out_dir``.
    ``template``: the chat template's tool-call style (``TEMPLATES``)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose one of {sorted(TEMPLATES)}")
    p = PRESETS[preset]
    tok = build_tokenizer(arch)
    tensors = make_weights(p, arch, tok.get_vocab_size(), seed, DTYPES[dtype])
    if not 1 <= num_shards <= len(tensors):
        raise ValueError(f"num_shards must be in [1, {len(tensors)}], got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    ids = special_token_ids(tok)
    write_json(out / "config.json", _model_config(p, arch, dtype, tok.get_vocab_size(), ids))
    generation = {"bos_token_id": ids[BOS], "eos_token_id": [ids[IM_END], ids[END_OF_TEXT]]}
    write_json(out / "generation_config.json", generation)
    write_tokenizer_config(out, arch, p.max_position_embeddings, ids, template)
    _save_tensors(tensors, out, num_shards)
    return out


def default_model_dir(preset: str = "tiny") -> Path:
    """The built-in model, made on first use; concurrent callers never see a partial one."""
    target = models_dir() / f"{preset}-llama-seed0"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        make_model(tmp, preset=preset)
        os.replace(tmp, target)
    except OSError:
        # Another process won the race; its (identical) model is already in place.
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def make_weights(
    p: Preset, arch: str, vocab_size: int, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """HF-named tensors; norms 1 + 0.1*randn and biases nonzero so a loader cannot skip them."""
    gen = torch.Generator().manual_seed(seed)
    h, q, kv = p.hidden_size, p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim

    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.02

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    t = {"model.embed_tokens.weight": matrix(vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        t[pre + "input_layernorm.weight"] = norm(h)
        t[pre + "self_attn.q_proj.weight"] = matrix(q, h)
        t[pre + "self_attn.k_proj.weight"] = matrix(kv, h)
        t[pre + "self_attn.v_proj.weight"] = matrix(kv, h)
        if arch == "qwen2":
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                t[pre + f"self_attn.{name}_proj.bias"] = 0.02 * torch.randn(n, generator=gen)
        if arch == "qwen3":
            t[pre + "self_attn.q_norm.weight"] = norm(p.head_dim)
            t[pre + "self_attn.k_norm.weight"] = norm(p.head_dim)
        t[pre + "self_attn.o_proj.weight"] = matrix(h, q)
        t[pre + "post_attention_layernorm.weight"] = norm(h)
        t[pre + "mlp.gate_proj.weight"] = matrix(p.intermediate_size, h)
        t[pre + "mlp.up_proj.weight"] = matrix(p.intermediate_size, h)
        t[pre + "mlp.down_proj.weight"] = matrix(h, p.intermediate_size)
    t["model.norm.weight"] = norm(h)
    if not p.tie_word_embeddings:
        t["lm_head.weight"] = matrix(vocab_size, h)
    return {name: x.to(dtype).contiguous() for name, x in t.items()}


def _model_config(
    p: Preset, arch: str, dtype: str, vocab_size: int, ids: dict[str, int]
) -> dict[str, Any]:
    # Top-level rope_theta is what transformers 4.x reads; 5.x reads rope_parameters.
    config: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": p.tie_word_embeddings,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[IM_END],
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
        config["max_window_layers"] = p.num_hidden_layers
    if arch == "qwen3":
        config["attention_bias"] = False
    return config


def _save_tensors(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    # Contiguous runs of tensors, the first (len % n) shards one longer.
    per, extra = divmod(len(names), num_shards)
    weight_map, start = {}, 0
    for i in range(num_shards):
        chunk = names[start : start + per + (i < extra)]
        start += len(chunk)
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    total = sum(x.numel() * x.element_size() for x in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(out / "model.safetensors.index.json", index)


def add_make_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    parser.add_argument(
        "--template",
        choices=sorted(TEMPLATES),
        default="hermes",
        help="chat template: plain ChatML, or with tools in Qwen/Hermes or Llama 3.1 style",
    )


def run_make_model(args: argparse.Namespace) -> int:
    out = make_model(
        args.out, args.preset, args.seed, args.arch, args.dtype, args.shards, args.template
    )
    print(f"wrote {args.preset} {args.arch} model to {out}")
    return 0
