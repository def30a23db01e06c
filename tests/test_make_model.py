"""models.make_model: deterministic HF checkpoints that transformers loads unmodified."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

from pdserve.models import make_model as mm
from pdserve.models.make_model import default_model_dir, make_model
from pdserve.models.make_tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("llama", "qwen2", "qwen3")
BOS, END_OF_TEXT, IM_END = 2043, 2044, 2046
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch=arch) for arch in ARCHS}


def _read(d: Path, name: str) -> dict:
    return json.loads((d / name).read_text(encoding="utf-8"))


def _bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _logits(d: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    with torch.no_grad():
        return model(torch.tensor([[BOS, 5, 300, 1999, 7, 42]])).logits


def test_tokenizer_training_is_deterministic() -> None:
    first, second = train_tokenizer(), train_tokenizer()
    assert first.to_str() == second.to_str()
    assert first.get_vocab_size() == 2048
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    assert [first.token_to_id(t) for t in specials] == [2043, 2044, 2045, 2046, 2047]
    assert [first.token_to_id(chr(c)) for c in (0x21, 0x41, 0x120)] == [0, 32, 220]  # ! A Ġ


def test_same_seed_same_bytes(models: dict[str, Path], tmp_path: Path) -> None:
    again = make_model(tmp_path / "again", arch="llama", seed=0)
    assert {p.name for p in again.iterdir()} == FILES
    assert _bytes(again) == _bytes(models["llama"])
    other = _bytes(make_model(tmp_path / "other", arch="llama", seed=1))
    same = _bytes(models["llama"])
    assert other["model.safetensors"] != same["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in same.items() if k != "model.safetensors"
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_weight(arch: str, models: dict[str, Path]) -> None:
    auto = transformers.AutoModelForCausalLM
    model, info = auto.from_pretrained(str(models[arch]), output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (
        set(),
        set(),
        set(),
    )
    assert type(model).__name__ == mm.ARCHS[arch]
    stored = load_file(str(models[arch] / "model.safetensors"))
    params = model.state_dict()
    for name, tensor in stored.items():
        assert torch.equal(params[name], tensor), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_names_and_init(arch: str, models: dict[str, Path]) -> None:
    tensors = load_file(str(models[arch] / "model.safetensors"))
    layer = {k.removeprefix("model.layers.0."): v.shape for k, v in tensors.items() if ".0." in k}
    want = {
        "input_layernorm.weight": (64,),
        "post_attention_layernorm.weight": (64,),
        "self_attn.q_proj.weight": (64, 64),
        "self_attn.k_proj.weight": (32, 64),
        "self_attn.v_proj.weight": (32, 64),
        "self_attn.o_proj.weight": (64, 64),
        "mlp.gate_proj.weight": (128, 64),
        "mlp.up_proj.weight": (128, 64),
        "mlp.down_proj.weight": (64, 128),
    }
    if arch == "qwen2":
        want.update({"self_attn.q_proj.bias": (64,), "self_attn.k_proj.bias": (32,)})
        want["self_attn.v_proj.bias"] = (32,)
    if arch == "qwen3":
        want.update({"self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,)})
    assert {k: tuple(v) for k, v in layer.items()} == want
    assert len(tensors) == 2 + 2 * len(want)  # embed + final norm, no lm_head (tied)
    assert tensors["model.embed_tokens.weight"].shape == (2048, 64)
    norm = tensors["model.norm.weight"]
    assert 0.05 < norm.std().item() < 0.2 and abs(norm.mean().item() - 1) < 0.05
    embed = tensors["model.embed_tokens.weight"]
    assert abs(embed.std().item() - 0.02) < 0.001
    for name, t in tensors.items():
        assert t.dtype == torch.float32 and bool((t != 0).all()), name
    with safe_open(str(models[arch] / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("arch", ARCHS)
def test_config_files(arch: str, models: dict[str, Path]) -> None:
    d = models[arch]
    config = _read(d, "config.json")
    assert config["architectures"] == [mm.ARCHS[arch]] and config["model_type"] == arch
    dims = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    assert [config[k] for k in dims] == [64, 128, 2, 4]
    assert (config["num_key_value_heads"], config["head_dim"]) == (2, 16)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (2048, 2048)
    assert (config["rope_theta"], config["rms_norm_eps"], config["hidden_act"]) == (
        10000.0,
        1e-6,
        "silu",
    )
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS, IM_END)
    assert (config["tie_word_embeddings"], config["dtype"], config["torch_dtype"]) == (
        True,
        "float32",
        "float32",
    )
    assert config.get("attention_bias", False) is False
    assert config.get("use_sliding_window", False) is False
    generation = _read(d, "generation_config.json")
    assert generation == {"bos_token_id": BOS, "eos_token_id": [IM_END, END_OF_TEXT]}
    tok_config = _read(d, "tokenizer_config.json")
    assert tok_config["bos_token"] == ("<|begin_of_text|>" if arch == "llama" else None)
    assert tok_config["chat_template"].startswith("{{ bos_token }}") == (arch == "llama")
    assert (tok_config["eos_token"], tok_config["pad_token"]) == ("<|im_end|>", "<|pad|>")
    assert len(tok_config["added_tokens_decoder"]) == 5
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(d))
    assert len(hf_tok) == config["vocab_size"]


def test_sharded_matches_single_file(models: dict[str, Path], tmp_path: Path) -> None:
    d = make_model(tmp_path / "sharded", arch="qwen2", num_shards=3)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in d.glob("*.safetensors")) == shards
    index = _read(d, "model.safetensors.index.json")
    single = load_file(str(models["qwen2"] / "model.safetensors"))
    assert sorted(index["weight_map"]) == sorted(single)
    assert set(index["weight_map"].values()) == set(shards)
    total = sum(t.numel() * t.element_size() for t in single.values())
    assert index["metadata"] == {"total_size": total}
    merged = {k: v for s in shards for k, v in load_file(str(d / s)).items()}
    assert merged.keys() == single.keys()
    assert all(torch.equal(merged[k], single[k]) for k in single)
    assert torch.equal(_logits(d), _logits(models["qwen2"]))


def test_small_preset_and_bfloat16(tmp_path: Path) -> None:
    d = make_model(tmp_path / "small", preset="small", dtype="bfloat16")
    config = _read(d, "config.json")
    dims = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    assert [config[k] for k in dims] == [512, 1024, 5, 8]
    assert (config["num_key_value_heads"], config["head_dim"]) == (4, 64)
    assert (config["max_position_embeddings"], config["tie_word_embeddings"]) == (4096, False)
    assert config["dtype"] == "bfloat16"
    tensors = load_file(str(d / "model.safetensors"))
    assert tensors["lm_head.weight"].shape == (2048, 512)
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert sum(t.numel() for t in tensors.values()) == 13_899_264


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        make_model(tmp_path, preset="huge")
    with pytest.raises(ValueError, match="unknown arch 'gpt2'"):
        make_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        make_model(tmp_path, dtype="int8")
    with pytest.raises(ValueError, match="num_shards must be in"):
        make_model(tmp_path, num_shards=0)


def test_default_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    d = default_model_dir()
    assert d == tmp_path / "models" / "tiny-llama-seed0"
    assert {p.name for p in d.iterdir()} == FILES
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == d
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama-seed0"]


def test_default_model_dir_concurrent_makers(tmp_path: Path) -> None:
    code = "from pdserve.models.make_model import default_model_dir; print(default_model_dir())"
    env = {**os.environ, "PDSERVE_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    target = tmp_path / "models" / "tiny-llama-seed0"
    assert [p.returncode for p in procs] == [0, 0, 0] and outs == [str(target)] * 3
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama-seed0"]
    assert {p.name for p in target.iterdir()} == FILES


def test_cli(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    mm.add_make_model_args(parser)
    args = parser.parse_args(["--out", str(tmp_path / "m"), "--arch", "qwen3", "--shards", "2"])
    assert (args.preset, args.seed, args.dtype) == ("tiny", 0, "float32")
    assert mm.run_make_model(args) == 0
    assert _read(tmp_path / "m", "config.json")["model_type"] == "qwen3"
    assert (tmp_path / "m" / "model-00002-of-00002.safetensors").is_file()
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "x", "--preset", "huge"])
