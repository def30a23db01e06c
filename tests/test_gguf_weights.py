"""GGUF blocks kept quantized (engine/quant/gguf_weights.py, gguf_model.py): each block type
becomes a ``QuantWeight`` whose weights are llama.cpp's own dequantization, Q/K rows come back
in Hugging Face's order, and a pulled Q4_1/Q8_0 GGUF is served by QuantLinear layers that hold
the float model's weights exactly."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pdserve.engine.loader import ModelLoadError, load_model
from pdserve.engine.quant.gguf_weights import quant_weight
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.weights import dequantize
from pdserve.engine.scheduler import Sequence
from pdserve.models.gguf import GGUFError, GGUFFile
from pdserve.models.gguf_convert import unpermute_rotary
from pdserve.models.pull import pull_model
from tests.engine_util import greedy, make_engine, prompts
from tests.test_gguf import write_gguf

Q = gguf.GGMLQuantizationType
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def one_tensor_gguf(path: Path, qtype: str, seed: int = 0) -> tuple[Path, np.ndarray]:
    """A GGUF holding one [12, 96] matrix "w" in ``qtype``; and its raw blocks."""
    rng = np.random.default_rng(seed)
    weights = (rng.standard_normal((12, 96)) * 3 + 0.5).astype(np.float32)
    raw = gguf.quants.quantize(weights, Q[qtype])
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("w", raw, raw_dtype=Q[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, raw


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_become_a_quant_weight_equal_to_llama_cpps_dequantization(tmp_path, qtype) -> None:
    path, raw = one_tensor_gguf(tmp_path / "w.gguf", qtype)
    with GGUFFile(path) as f:
        w = quant_weight(f, "w")
    kind = "i8" if qtype == "Q8_0" else "u4"
    assert (w.kind, w.group, w.name, w.shape) == (kind, 32, qtype, (12, 96))
    expected = gguf.quants.dequantize(raw, Q[qtype])
    got = dequantize(w).numpy()
    np.testing.assert_array_equal(got, expected)
    # bit for bit; Q4_0's q·d + (-8·d) gives +0 where llama.cpp's (q - 8)·d gives -0 (d < 0)
    nonzero = expected != 0
    assert np.array_equal(got.view(np.uint32)[nonzero], expected.view(np.uint32)[nonzero])
    if qtype != "Q4_0":
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    # the codes are the file's bytes, unchanged (llama.cpp's nibble order is QuantWeight's)
    blocks = raw.view(np.uint8).reshape(12, 3, BLOCK_BYTES[qtype])
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[qtype]
    codes = w.data.numpy().view(np.uint8)
    assert np.array_equal(codes, blocks[:, :, head:].reshape(12, -1))
    assert np.array_equal(w.scales.numpy(), blocks[:, :, :2].copy().view(np.float16)[:, :, 0])
    # what a matmul reads: the file's bytes, and Q4_0's minimum besides
    assert w.nbytes == 12 * 3 * (BLOCK_BYTES[qtype] + (2 if qtype == "Q4_0" else 0))


@pytest.mark.parametrize("heads", [1, 2, 3])
def test_q_and_k_rows_are_put_back_as_the_float_conversion_puts_them(tmp_path, heads) -> None:
    path, _ = one_tensor_gguf(tmp_path / "w.gguf", "Q4_1", seed=heads)
    with GGUFFile(path) as f:
        floats = unpermute_rotary(f.dequantize("w"), heads)  # what gguf_convert writes
        kept, as_stored = quant_weight(f, "w", rotary_heads=heads), quant_weight(f, "w")
    assert np.array_equal(dequantize(kept).numpy(), floats)
    assert not np.array_equal(dequantize(as_stored).numpy(), floats)  # a real permutation


@pytest.fixture(scope="module")
def pulled(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model as the real one comes: Q4_1 matrices, a Q8_0 embedding (tied), F32
    norms; pulled like any local .gguf."""
    home = tmp_path_factory.mktemp("home")
    path = write_gguf(tiny_dir, home / "tiny-q.gguf", Q.Q4_1, {"token_embd.weight": Q.Q8_0})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_HOME", str(home))
        return pull_model(str(path))


def test_a_pulled_gguf_is_served_by_quant_linear_layers(pulled) -> None:
    kept = load_model(pulled)
    assert kept.quantization == "gguf Q4_1+Q8_0"
    quantized = [n for n, m in kept.named_modules() if isinstance(m, QuantLinear)]
    layers = [f"layers.{i}.{name}" for i in range(2) for name in LINEARS]
    assert quantized == [*layers, "tied_head"]
    assert not [n for n, m in kept.named_modules() if isinstance(m, nn.Linear)]
    qkv = kept.layers[0].self_attn.qkv_proj.weight
    assert (qkv.kind, qkv.name, qkv.shape) == ("u4", "Q4_1", ((4 + 2 + 2) * 16, 64))
    head = kept.tied_head.weight
    assert (head.kind, head.name, head.shape) == ("i8", "Q8_0", (kept.config.vocab_size, 64))
    # the same weights exactly as the float model converted from the same file
    floats = load_model(pulled, quantization="none")
    assert floats.quantization == "none" and floats.tied_head is None
    for name in layers:
        mine = dequantize(kept.get_submodule(name).weight)
        assert torch.equal(mine, floats.get_submodule(name).weight), name
    assert torch.equal(dequantize(head), floats.embed_tokens.weight)
    assert torch.equal(kept.embed_tokens.weight, floats.embed_tokens.weight)
    float_params = dict(floats.named_parameters())
    norms = [(n, p) for n, p in kept.named_parameters() if "norm" in n]
    assert len(norms) == 5
    for name, p in norms:
        assert torch.equal(p, float_params[name]), name


def test_without_the_float_file_none_dequantizes_the_gguf(pulled, tmp_path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(pulled, bare)
    (bare / "model.safetensors").unlink()
    a, b = load_model(bare, quantization="none"), load_model(pulled, quantization="none")
    assert a.quantization == "none"
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name
    with pytest.raises(ModelLoadError, match="unknown quantization 'int3'"):
        load_model(pulled, quantization="int3")


def last_logits(path: Path, quantization: str, batch: list[list[int]]) -> torch.Tensor:
    """An engine's prefill logits of each prompt's last token, its weights as asked."""
    engine = make_engine(path, quantization=quantization, quant_activations="float32")
    assert engine.runner.model.quantization == {"auto": "gguf Q4_1+Q8_0"}.get(quantization, "none")
    seqs = [Sequence(f"r{i}", p, greedy(1)) for i, p in enumerate(batch)]
    for s in seqs:
        engine.scheduler.add(s)
    step = engine.scheduler.schedule()
    return engine.runner.execute(engine.runner.prepare(step.seqs, step.num_new_tokens))


def test_kept_logits_equal_the_float_models_to_float32_summation(pulled) -> None:
    vocab = json.loads((pulled / "config.json").read_text())["vocab_size"]
    batch = prompts(vocab, [5, 17, 40], seed=4)
    got, want = last_logits(pulled, "auto", batch), last_logits(pulled, "none", batch)
    # The weights are the same; only the order of each dot product's float32 sum differs.
    # Each of the path's 9 matmuls (4 a layer, the head; K <= 128) rounds both ways to about
    # sqrt(K)·u of its output's scale (u = 2^-24; the probabilistic bound of Higham & Mary,
    # the worst case K·u being held layer by layer below), carried to the logits' scale.
    # Measured: at most 1.8e-7 apart; Q/K rows left in llama.cpp's order: 7.5e-3.
    u, k, matmuls = 2.0**-24, 128, 9
    scale = (want.abs().max() + 1) * matmuls * 2 * k**0.5 * u
    torch.testing.assert_close(got, want, atol=scale.item(), rtol=0)


def test_each_kept_layer_is_within_float32_summation_of_the_exact_product(pulled) -> None:
    """Each QuantLinear's output against the exact (float64) product of its own weights: any
    order of K float32 multiply-adds is within gamma_K · (|W| @ |x|) of it, no closer bound
    is promised and a kernel that read a weight wrong would miss it by far more."""
    kept = load_model(pulled)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    for name, layer in kept.named_modules():
        if not isinstance(layer, QuantLinear):
            continue
        w = dequantize(layer.weight)
        k = w.shape[1]
        inputs = x[:, :k].contiguous()
        exact = inputs.double() @ w.double().T
        gamma = k * 2**-24 / (1 - k * 2**-24)
        bound = gamma * (inputs.abs().double() @ w.abs().double().T)
        error = (layer(inputs).double() - exact).abs()
        assert (error <= bound).all(), (name, (error - bound).max().item())


def test_an_untied_head_and_a_mixed_fused_layer(tiny_dir, tmp_path, monkeypatch, caplog) -> None:
    """output.weight becomes the lm_head (Q8_0 here); a fused layer whose parts differ (attn_v
    Q8_0 beside Q4_1 q and k) is loaded as float, saying so, its weights still exact."""
    untied = tmp_path / "untied"
    shutil.copytree(tiny_dir, untied)
    tensors = load_file(str(untied / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape) * 0.05
    save_file(tensors, str(untied / "model.safetensors"))
    config = json.loads((untied / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    overrides = {"output.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.Q8_0}
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    path = pull_model(str(write_gguf(untied, tmp_path / "untied.gguf", Q.Q4_1, overrides)))
    with caplog.at_level(logging.INFO, logger="pdserve.engine.quant.gguf_model"):
        kept = load_model(path)
    assert "blk.1.attn_q.weight Q4_1, blk.1.attn_k.weight Q4_1, blk.1.attn_v.weight Q8_0" in (
        caplog.text
    )
    floats = load_model(path, quantization="none")
    assert kept.tied_head is None and isinstance(kept.lm_head, QuantLinear)
    assert kept.lm_head.weight.name == "Q8_0" and kept.quantization == "gguf Q4_1+Q8_0"
    assert torch.equal(dequantize(kept.lm_head.weight), floats.lm_head.weight)
    mixed = kept.layers[1].self_attn.qkv_proj
    assert type(mixed) is nn.Linear and torch.equal(
        mixed.weight, floats.get_submodule("layers.1.self_attn.qkv_proj").weight
    )
    assert isinstance(kept.layers[0].self_attn.qkv_proj, QuantLinear)


def test_k_quants_are_refused_naming_the_tensor_and_type(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 144), np.uint8), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"tensor blk\.0\.ffn_down\.weight has ggml type Q4_K"):
        GGUFFile(tmp_path / "k.gguf")
