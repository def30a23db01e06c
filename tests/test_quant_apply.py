"""``quantize_model`` and the engine's quantization settings: every linear layer swapped, the
single engine's greedy tokens with quantized weights (a sequence's tokens and logprobs the same
alone or batched), the flags, and KV layouts that tell weight forms apart."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from pdserve.engine.cli_args import add_engine_args, engine_config_from_args
from pdserve.engine.config import ConfigError, EngineConfig
from pdserve.engine.loader import load_model
from pdserve.engine.quant.apply import quantize_model
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.weights import dequantize
from pdserve.kvtransfer.base import LayoutMismatchError, check_layouts
from pdserve.launch.serve import add_serve_args, worker_commands
from pdserve.protocol.control import KVLayout
from pdserve.worker.wire import kv_layout
from tests.engine_util import greedy, make_engine, prompts


@pytest.mark.parametrize(("method", "label"), [("int8", "int8"), ("int4", "int4-g64")])
def test_quantize_model_swaps_every_linear(tiny_dir: Path, method: str, label: str) -> None:
    """The tiny model (tied embedding, 2 layers): 4 linear layers a layer and the head become
    QuantLinear, each the quantization of its float weight (the head int8 in int4 mode too);
    the lookup stays float."""
    model = load_model(tiny_dir)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    floats = {n: m.weight.detach().clone() for n, m in linears}
    embedding = model.embed_tokens.weight.detach().clone()
    quantize_model(model, method, 64)
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert not [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert sorted(quant) == sorted([*floats, "tied_head"])
    assert len(floats) == 2 * 4 and model.lm_head is None
    assert model.quantization == label
    assert torch.equal(model.embed_tokens.weight, embedding)
    for name, layer in quant.items():
        w = layer.weight
        int8 = method == "int8" or name == "tied_head"
        assert (w.kind, w.group) == (("i8", w.shape[1]) if int8 else ("u4", 64)), name
        dense = floats.get(name, embedding)
        step = w.scales.float().amax()  # one quantization step, at most
        assert (dequantize(w) - dense).abs().max() <= step / (2 if int8 else 1)


def test_a_group_that_does_not_fit_names_the_layer(tiny_dir: Path) -> None:
    model = load_model(tiny_dir)  # widths 64 and 128: 96 divides neither
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj \[128, 64\]: int4 group"):
        quantize_model(model, "int4", 96)
    with pytest.raises(ValueError, match="must be one of int8, int4"):
        quantize_model(model, "int3", 32)


def test_engine_greedy_tokens_do_not_depend_on_the_batch(tiny_dir: Path, caplog) -> None:
    """int4 and int8 engines run; each prompt's tokens and logprobs are the same bits alone
    and in a batch of four (the kernel's arithmetic does not depend on the batch)."""
    for method in ("int8", "int4"):
        with caplog.at_level(logging.INFO, logger="pdserve.engine.model_runner"):
            engine = make_engine(tiny_dir, quantization=method, prefix_caching=False)
        model = engine.runner.model
        assert isinstance(model.tied_head, QuantLinear)
        assert f"weights {model.quantization}: " in caplog.text
        assert "linear quantized" in caplog.text
        batch = prompts(engine.model_config.vocab_size, [3, 9, 17, 30])
        params = greedy(6, logprobs=0)
        together = engine.generate(batch, params)
        for prompt, out in zip(batch, together, strict=True):
            (alone,) = engine.generate([prompt], params)
            assert len(out.new_token_ids) == 6
            assert alone.new_token_ids == out.new_token_ids
            assert alone.new_logprobs == out.new_logprobs
        assert engine.status.num_free_blocks == engine.status.num_blocks


def test_config_and_flags(tiny_dir: Path) -> None:
    for bad in [{"quantization": "int3"}, {"quant_group_size": 48}, {"quant_group_size": 0}]:
        with pytest.raises(ConfigError):
            EngineConfig(model="m", **bad)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    model = f"--model={tiny_dir}"
    args = parser.parse_args([model, "--quantization=int4", "--quant-group-size=64"])
    config = engine_config_from_args(args)
    assert (config.quantization, config.quant_group_size) == ("int4", 64)
    default = engine_config_from_args(parser.parse_args([model]))
    assert (default.quantization, default.quant_group_size) == ("auto", 32)
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    serve_args = serve.parse_args(["--model=tiny", "--quantization=int8", "--quant-group-size=64"])
    for cmd in worker_commands(serve_args, "tcp://127.0.0.1:1", "/models/tiny"):
        assert {"--quantization=int8", "--quant-group-size=64"} <= set(cmd)


def test_layouts_name_the_weights(tiny_dir: Path) -> None:
    """A float worker and an int4 one hold different KV for the same tokens: never paired;
    nor int4 workers on float32 and on int8 activations."""
    engine = make_engine(tiny_dir, quantization="int4", num_blocks=8, quant_activations="float32")
    layout = kv_layout(engine)
    assert layout.weights == "int4-g32"
    float_layout = KVLayout(**{**layout.__dict__, "weights": "none"})
    with pytest.raises(LayoutMismatchError, match="weights a='int4-g32' b='none'"):
        check_layouts(layout, float_layout)
    check_layouts(layout, KVLayout(**layout.__dict__))
    a16 = kv_layout(make_engine(tiny_dir, quantization="int4", num_blocks=8))  # auto: int16
    assert a16.weights == "int4-g32, int16 activations"
    with pytest.raises(LayoutMismatchError, match="weights a='int4-g32' b='int4-g32, int16 act"):
        check_layouts(layout, a16)
    a8 = make_engine(tiny_dir, quantization="int4", num_blocks=8, quant_activations="int8")
    with pytest.raises(LayoutMismatchError, match="int16 activations' b='int4-g32, int8 act"):
        check_layouts(a16, kv_layout(a8))
