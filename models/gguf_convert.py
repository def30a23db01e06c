"""Turn a Llama-family GGUF file into a Hugging Face model directory that both pdserve and
``transformers`` load unmodified.

    out/ config.json  generation_config.json  model.safetensors
         tokenizer.json  tokenizer_config.json  special_tokens_map.json

Weights are dequantized to float32 and saved in the dtype asked for. llama.cpp stores the Q
and K projections with each head's rotary halves interleaved; they are permuted back to
Hugging Face's "rotate half" order here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from pdserve.models.gguf import GGUFError, GGUFFile

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER_NAMES = {  # GGUF name within blk.{i}. -> Hugging Face name within model.layers.{i}.
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that are added (special) tokens
# SmolLM2's chat template (every size): plain ChatML with a default system turn, no tools
_CHATML_DEFAULT_SYSTEM = re.compile(
    r"\{% for message in messages %\}\{% if loop\.first and messages\[0\]\['role'\] != 'system' "
    r"%\}\{\{ '<\|im_start\|>system\n(?P<system>[^'\\{}%]*)<\|im_end\|>\n' \}\}\{% endif %\}"
    r"\{\{'<\|im_start\|>' \+ message\['role'\] \+ '\n' \+ message\['content'\] \+ "
    r"'<\|im_end\|>' \+ '\n'\}\}\{% endfor %\}\{% if add_generation_prompt %\}"
    r"\{\{ '<\|im_start\|>assistant\n' \}\}\{% endif %\}"
)


@dataclass(frozen=True)
class Converted:
    """What a conversion wrote, for the model cache's metadata."""

    out_dir: Path
    num_parameters: int
    kv_bytes_per_token: int
    weight_bytes: int


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Converted:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    f = GGUFFile(gguf_path)
    try:
        arch = f.field("general.architecture")
        if arch != "llama":
            raise GGUFError(f"{gguf_path}: architecture {arch!r} is not supported (llama only)")
        config = hf_config(f, dtype)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = hf_tensors(f, config, DTYPES[dtype])
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer(f, out, config)
    finally:
        f.close()
    _write_json(out / "config.json", config)
    num_params = sum(t.numel() for t in tensors.values())
    kv_per_token = (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * config["head_dim"]
        * DTYPES[dtype].itemsize
    )
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Converted(out, num_params, kv_per_token, weight_bytes)


def hf_config(f: GGUFFile, dtype: str) -> dict[str, Any]:
    """config.json for a ``LlamaForCausalLM`` from the GGUF's ``llama.*`` fields."""

    def need(key: str) -> Any:
        value = f.field(f"llama.{key}")
        if value is None:
            raise GGUFError(f"{f.path}: metadata field llama.{key} is missing")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = f.field("llama.vocab_size") or len(f.field("tokenizer.ggml.tokens") or [])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.field("llama.attention.head_count_kv") or heads),
        "head_dim": int(f.field("llama.rope.dimension_count") or hidden // heads),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(f.field("llama.rope.freq_base") or 10000.0),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "bos_token_id": f.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.field("tokenizer.ggml.eos_token_id"),
        "torch_dtype": dtype,
    }


def hf_tensors(f: GGUFFile, config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = {name: w.to(dtype) for name, w in iter_hf_tensors(f, *heads)}
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - out.keys()
    if missing:
        raise GGUFError(f"{f.path}: missing tensor(s) {', '.join(sorted(missing))}")
    return out


def iter_hf_tensors(
    f: GGUFFile, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor as float32 under its Hugging Face name, Q and K in Hugging Face's order."""
    for name in f.tensors:
        out_name = hf_name(name)
        if out_name is None:
            raise GGUFError(f"{f.path}: tensor {name} has no Hugging Face Llama counterpart")
        w = f.dequantize(name)
        heads = rotary_heads(name, num_heads, num_kv_heads)
        if heads is not None:
            w = unpermute_rotary(w, heads)
        yield out_name, torch.from_numpy(np.ascontiguousarray(w))


def rotary_heads(name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """The head count whose rotary row order GGUF tensor ``name`` is stored in (Q or K)."""
    if name.endswith("attn_q.weight"):
        return num_heads
    if name.endswith("attn_k.weight"):
        return num_kv_heads
    return None


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert interleaves each head's rows [x0, y0, x1, y1, ...]; Hugging Face
    keeps them as halves [x0, x1, ..., y0, y1, ...]."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str) -> str | None:
    """GGUF tensor ``name`` -> its Hugging Face Llama name (None: it has none)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    prefix, _, rest = name.partition(".")
    layer, _, leaf = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and leaf in _LAYER_NAMES:
        return f"model.layers.{layer}.{_LAYER_NAMES[leaf]}"
    return None


# ---- tokenizer -------------------------------------------------------------------------------
def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's pre-tokenizer names, as the ``tokenizers`` pipeline that splits the same."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):  # one digit per token, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt-2", "gpt2"):
        return byte_level
    raise GGUFError(f"tokenizer pre-type {pre!r} is not supported (smollm, gpt-2)")


def build_tokenizer(f: GGUFFile) -> tokenizers.Tokenizer:
    """The byte-level BPE tokenizer the GGUF describes (``tokenizer.ggml.model`` gpt2)."""
    kind = f.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{f.path}: tokenizer model {kind!r} is not supported (gpt2 BPE only)")
    tokens: list[str] = f.field("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in f.field("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(f.field("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    bos = f.field("tokenizer.ggml.bos_token_id")
    if f.field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        b = tokens[bos]  # the bos token before every sequence, as llama.cpp adds it
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{b} $A", pair=f"{b} $A {b}:1 $B:1", special_tokens=[(b, bos)]
                ),
            ]
        )
    types = f.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(types)
        if kind in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens(specials)
    return tok


def write_tokenizer(f: GGUFFile, out: Path, config: dict[str, Any]) -> None:
    tok = build_tokenizer(f)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    tokens = f.field("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = f.field(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    named = {k: token(k) for k in ("bos", "eos", "unknown", "padding")}
    added = {
        str(i): {
            "content": tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, kind in enumerate(f.field("tokenizer.ggml.token_type") or [])
        if kind in (CONTROL, USER_DEFINED)
    }
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(f.field("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "bos_token": named["bos"],
        "eos_token": named["eos"],
        "unk_token": named["unknown"],
        "pad_token": named["padding"],
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }
    template = f.field("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = tool_chat_template(template)
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    special_map = {
        f"{k}_token": v
        for k, v in (("bos", named["bos"]), ("eos", named["eos"]), ("unk", named["unknown"]))
        if v is not None
    }
    if named["padding"] is not None:
        special_map["pad_token"] = named["padding"]
    _write_json(out / "special_tokens_map.json", special_map)
    # llama.cpp ends generation at eos, end-of-turn and end-of-message alike
    ends = [f.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(i for i in ends if i is not None))
    eos = ends[0] if len(ends) == 1 else ends or None
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos}
    _write_json(out / "generation_config.json", generation)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def tool_chat_template(template: str) -> str:
    """``template``, or, for SmolLM2's, the same ChatML turns with tools in the Qwen/Hermes
    style (``models/data/chatml_tools.jinja``, with its default system turn): it renders every
    conversation without tools exactly as the original does, and tool calls, tool results
    and a tools list besides, so ``tools`` reach the model (vLLM would ignore them)."""
    match = _CHATML_DEFAULT_SYSTEM.fullmatch(template)
    if match is None:
        return template
    tools = (Path(__file__).parent / "data" / "chatml_tools.jinja").read_text(encoding="utf-8")
    return "{%- set default_system = '" + match["system"] + "' %}\n" + tools.strip()
