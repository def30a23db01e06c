"""GGUF reading, dequantization and conversion, checked against the ``gguf`` package (the
llama.cpp project's own Python reference) and against the checkpoint a GGUF was made from."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pdserve.engine.tokenizer import Tokenizer
from pdserve.models.gguf import BF16, F16, F32, Q4_0, Q4_1, Q8_0, GGUFError, GGUFFile, dequantize
from pdserve.models.gguf_convert import convert_gguf, unpermute_rotary
from tests.engine_util import greedy, make_engine

QTYPES = {
    Q4_0: gguf.GGMLQuantizationType.Q4_0,
    Q4_1: gguf.GGMLQuantizationType.Q4_1,
    Q8_0: gguf.GGMLQuantizationType.Q8_0,
    F16: gguf.GGMLQuantizationType.F16,
    BF16: gguf.GGMLQuantizationType.BF16,
    F32: gguf.GGMLQuantizationType.F32,
}


@pytest.mark.parametrize("ttype", sorted(QTYPES))
def test_dequantize_equals_the_gguf_reference(ttype: int) -> None:
    rng = np.random.default_rng(ttype)
    weights = (rng.standard_normal((8, 64)) * 3 + 0.5).astype(np.float32)
    raw = gguf.quants.quantize(weights, QTYPES[ttype])
    expected = gguf.quants.dequantize(raw, QTYPES[ttype]).reshape(-1)
    mine = dequantize(raw.view(np.uint8).reshape(-1), ttype)
    np.testing.assert_array_equal(mine, expected)
    # and it is within one quantization step of the weights it came from
    scale = {Q4_0: 1 / 7, Q4_1: 1 / 7, Q8_0: 1 / 127, F16: 2**-10, BF16: 2**-7, F32: 0.0}
    step = np.abs(weights).max() * scale[ttype]
    assert np.abs(mine - weights.reshape(-1)).max() <= step


def permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to q_proj and k_proj."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_rotary_inverts_llama_cpp() -> None:
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3):
        np.testing.assert_array_equal(unpermute_rotary(permute_like_llama_cpp(w, heads), heads), w)
    # head 0 of 2 heads x 6 rows: interleaved rows [x0 y0 x1 y1 x2 y2] -> [x0 x1 x2 y0 y1 y2]
    rows = unpermute_rotary(np.arange(12, dtype=np.float32)[:, None], 2)[:6, 0]
    assert rows.tolist() == [0, 2, 4, 1, 3, 5]


def write_gguf(
    model_dir: Path,
    out: Path,
    qtype: gguf.GGMLQuantizationType | None,
    overrides: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """A llama.cpp-style GGUF of a Hugging Face checkpoint (``make-model``'s tiny one): its
    matrices in ``qtype`` (None: float32), or in ``overrides[GGUF name]``'s."""
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [specials.get(i, t) for t, i in vocab]
    tokens += [specials[i] for i in sorted(specials) if i >= len(tokens)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tokens.index(tok_cfg["bos_token"]))
    w.add_eos_token_id(tokens.index(tok_cfg["eos_token"]))  # the first generation eos
    w.add_add_bos_token(tok_cfg["add_bos_token"])
    ends = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    w.add_eot_token_id(ends[1])
    w.add_chat_template(tok_cfg["chat_template"])
    names = {v: k for k, v in _gguf_names(cfg["num_hidden_layers"]).items()}
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        data = t.float().numpy()
        if name.endswith("q_proj.weight"):
            data = permute_like_llama_cpp(data, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            data = permute_like_llama_cpp(data, cfg["num_key_value_heads"])
        kind = (overrides or {}).get(names[name], qtype)
        if kind is not None and data.ndim == 2:
            w.add_tensor(names[name], gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(names[name], data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_names(layers: int) -> dict[str, str]:
    from pdserve.models.gguf_convert import _GLOBAL_NAMES, _LAYER_NAMES

    names = dict(_GLOBAL_NAMES)
    for i in range(layers):
        names.update({f"blk.{i}.{k}": f"model.layers.{i}.{v}" for k, v in _LAYER_NAMES.items()})
    return names


def test_a_float_gguf_converts_back_to_the_same_checkpoint(tiny_dir: Path, tmp_path) -> None:
    converted = convert_gguf(write_gguf(tiny_dir, tmp_path / "m.gguf", None), tmp_path / "out")
    original = load_file(str(tiny_dir / "model.safetensors"))
    mine = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(mine) == sorted(original)  # tied embeddings: no lm_head either side
    for name, t in original.items():
        assert torch.equal(mine[name], t), name
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"]
    assert "quantization_config" not in cfg
    assert converted.num_parameters == sum(t.numel() for t in original.values())
    assert converted.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers, K+V, kv heads, dim, fp32
    # the tokenizer encodes, decodes and templates exactly as the original does
    a, b = Tokenizer.from_dir(tiny_dir), Tokenizer.from_dir(tmp_path / "out")
    text = "Serving systems split prefill 12345, naïve 数字!\n\n  <|im_start|>"
    assert b.encode(text) == a.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert b.apply_chat_template(chat, add_generation_prompt=True) == a.apply_chat_template(
        chat, add_generation_prompt=True
    )
    assert b.eos_token_ids == a.eos_token_ids
    prompt = a.encode("The quick brown fox")
    want = make_engine(tiny_dir).generate([prompt], greedy(12))[0].new_token_ids
    assert make_engine(tmp_path / "out").generate([prompt], greedy(12))[0].new_token_ids == want


def test_a_q4_1_gguf_dequantizes_to_what_llama_cpp_would(tiny_dir: Path, tmp_path) -> None:
    qtype = gguf.GGMLQuantizationType.Q4_1
    path = write_gguf(tiny_dir, tmp_path / "q.gguf", qtype)
    convert_gguf(path, tmp_path / "out", dtype="bfloat16")
    reader = gguf.GGUFReader(str(path))
    mine = load_file(str(tmp_path / "out" / "model.safetensors"))
    ref = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    expected = gguf.quants.dequantize(ref.data, qtype)
    got = mine["model.layers.1.mlp.down_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.from_numpy(expected).to(torch.bfloat16))


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda b: b"GGML" + b[4:], "bad magic"),
        (lambda b: b[: len(b) // 3], "truncated|past the end"),
        (lambda b: b[:4] + (9).to_bytes(4, "little") + b[8:], "version 9"),
        (lambda b: b[:8] + (2**40).to_bytes(8, "little") + b[16:], "cannot fit"),
    ],
)
def test_a_malformed_file_is_refused_with_a_reason(tiny_dir, tmp_path, mangle, message) -> None:
    good = write_gguf(tiny_dir, tmp_path / "m.gguf", None).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mangle(good))
    with pytest.raises(GGUFError, match=message):
        GGUFFile(bad)
