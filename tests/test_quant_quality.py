"""The tiny model quantized (int8, int4-g32) is held to tolerances derived from its measured
quantization error, not to a loose one.

Notation: a float linear layer y = x W^T; its quantized form Wq = dequantize(quantize(W)) (the
weights the kernel multiplies by, bit for bit); the weight error E = W - Wq, measured per
layer. u = float32 eps (2^-23, twice the unit roundoff: conservative by 2x) and
gamma(K) = K u / (1 - K u): a float32 dot product of length K, in any order, with or without
fma, is within gamma(K) * sum_k |x_k w_k| of its exact value (Higham, Accuracy and Stability
of Numerical Algorithms, 3.1), so two such products of the same vectors differ by at most
twice that ("rounding" below).

- One layer, exactly: y_f - y_q = x E^T, to rounding (the error is the weight error carried
  by the input, nothing else); so by Cauchy-Schwarz |y_f - y_q|[t, n] <= |x_t| |E_n|.
- The whole model on the same weights: the quantized model's logits equal those of the float
  model whose linear weights are replaced by Wq, to float32 summation order.
- The whole model, float against quantized: every linear layer's output difference obeys
      y_q - y_f = (x_q - x_f) W^T - x_q E^T
      |y_q - y_f|[t, n] <= |x_q,t - x_f,t| |W_n| + |x_q,t| |E_n|   (+ rounding)
  with x_q, x_f the inputs each model really gave the layer (the first layer's are equal:
  the embedding and the first norm stay float). The tied head is the last such layer, so
  the logits difference is bounded by the final hidden states' difference and the
  embedding's quantization error.
- Greedy: where float32's top-2 logit margin at a position exceeds twice that position's
  logits bound, the quantized argmax is float32's; the quantized engine's greedy decode (KV
  cache, batch-1 kernels) must reproduce float32's tokens up to the first position where it
  does not, and those positions must be most of them (else the test proves little).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.bench.experiments.quant_quality import step_logits
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.quant.linear import QuantLinear
from pdserve.engine.quant.weights import dequantize, quantize_int4, quantize_int8
from tests.engine_util import greedy, prompts

EPS = torch.finfo(torch.float32).eps
METHODS = {"int8": ("int8", 32), "int4-g32": ("int4", 32)}


def gamma(k: int) -> float:
    return k * EPS / (1 - k * EPS)


def rounding(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[T, N]: how far two float32 evaluations of x w^T can lie apart (module docstring)."""
    return 2 * gamma(x.shape[-1]) * (x.abs() @ w.abs().T)


def engine(path, method: str) -> LLMEngine:
    """The tiny model in ``method`` ("none": float32); its float layers stay nn.Linear (no
    oneDNN packing), so hooks and weights can be reached; no start-up step timing. The
    quantized layers on float32 activations: the bounds here are the weights' error alone
    (int8 activations: tests/test_qdot.py)."""
    quantization, group = METHODS.get(method, ("none", 32))
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            cpu_linear="torch",
            quantization=quantization,
            quant_group_size=group,
            quant_activations="float32",
            cache=CacheConfig(block_size=16, num_blocks=64, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_step_time_s=0),
        )
    )


@pytest.fixture(scope="module")
def engines(tiny_dir) -> dict[str, LLMEngine]:
    return {m: engine(tiny_dir, m) for m in ("none", *METHODS)}


def quantized_layers(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def float_weight(model: nn.Module, name: str) -> torch.Tensor:
    """The float model's weight for quantized layer ``name`` (the tied head: the embedding)."""
    if name == "tied_head":
        return model.embed_tokens.weight.detach()
    return model.get_submodule(name).weight.detach()


@contextmanager
def recording(model: nn.Module, names: list[str]) -> Iterator[dict[str, tuple]]:
    """Each named module's last (input, output) while the block runs: copies, since the step
    goes on to change some in place (rope rotates the q/k part of qkv_proj's output)."""
    seen: dict[str, tuple] = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda _m, args, out, n=n: seen.__setitem__(
                n, (args[0].detach().clone(), out.detach().clone())
            )
        )
        for n in names
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def test_the_model_holds_the_reference_quantization_of_its_float_weights(engines) -> None:
    floats = engines["none"].runner.model
    for method, (quantization, group) in METHODS.items():
        layers = quantized_layers(engines[method].runner.model)
        names = [
            f"layers.{i}.{n}"
            for i in range(2)
            for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        ]
        assert list(layers) == [*names, "tied_head"], method
        for name, layer in layers.items():
            w = float_weight(floats, name)
            # the head stays int8 in int4 mode (engine/quant/apply.py)
            int8 = quantization == "int8" or name == "tied_head"
            ref = quantize_int8(w) if int8 else quantize_int4(w, group)
            got = layer.weight
            assert torch.equal(got.data, ref.data) and torch.equal(got.scales, ref.scales), name
            assert (got.mins is None) == (ref.mins is None), name
            assert got.mins is None or torch.equal(got.mins, ref.mins), name


@pytest.mark.parametrize("method", list(METHODS))
def test_one_layer_output_error_is_the_weight_error_carried_by_its_input(engines, method) -> None:
    floats, quant = engines["none"].runner.model, engines[method].runner.model
    ids = torch.tensor(prompts(floats.config.vocab_size, [24], seed=3)[0])
    with torch.inference_mode():
        x = floats.layers[0].input_layernorm(floats.embed_tokens(ids))  # [T, E]: qkv's input
        w = float_weight(floats, "layers.0.self_attn.qkv_proj")
        layer = quant.layers[0].self_attn.qkv_proj
        wq = dequantize(layer.weight)
        e = w - wq
        y_f, y_q = F.linear(x, w), layer(x)
    slack = rounding(x, w) + rounding(x, wq)
    # the kernel multiplies by Wq exactly (to summation order)
    assert ((y_q - F.linear(x, wq)).abs() <= rounding(x, wq)).all()
    # exact propagation: the output error is x E^T
    assert ((y_f - y_q - x @ e.T).abs() <= slack + rounding(x, e)).all()
    # Cauchy-Schwarz, and the error is there to be seen (a quantization that did nothing fails)
    diff = (y_f - y_q).abs()
    assert (diff <= x.norm(dim=1, keepdim=True) * e.norm(dim=1) + slack).all()
    assert diff.max() > 100 * slack.max()


def dequantized_float_model(engines, method: str) -> LLMEngine:
    """The float engine's model with every quantized layer's weights replaced by Wq."""
    target = engines["none"]
    model = target.runner.model
    with torch.no_grad():
        for name, layer in quantized_layers(engines[method].runner.model).items():
            wq = dequantize(layer.weight)
            if name == "tied_head":
                model.tied_head = nn.Linear(wq.shape[1], wq.shape[0], bias=False)
                model.tied_head.weight.copy_(wq)
            else:
                model.get_submodule(name).weight.copy_(wq)
    return target


@pytest.mark.parametrize("method", list(METHODS))
def test_logits_equal_the_float_models_on_the_dequantized_weights(tiny_dir, method) -> None:
    floats, quant = engine(tiny_dir, "none"), engine(tiny_dir, method)
    same = dequantized_float_model({"none": floats, method: quant}, method)
    tokens = prompts(quant.model_config.vocab_size, [40], seed=5)[0]
    got, want = step_logits(quant, tokens), step_logits(same, tokens)
    # same weights: only summation order differs. Each of the nine matmuls a logit depends on
    # (2 layers x 4, and the head; K <= 128) is within 2 gamma(K) of the other's, relative to
    # its magnitudes, which the largest logit stands for (layer_bounds holds each layer to its
    # own rounding bound exactly).
    atol = want.abs().max().item() * 9 * 2 * gamma(128)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    # while the float weights' own logits are further off: the check can see quantization
    plain = step_logits(engine(tiny_dir, "none"), tokens)
    assert (plain - got).abs().max() > 10 * atol


def layer_bounds(engines, method: str, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Per quantized layer: (|y_q - y_f|, its bound) stacked [2, T, N]; "logits" included."""
    floats, quant = engines["none"].runner.model, engines[method].runner.model
    layers = quantized_layers(quant)
    linears = [n for n in layers if n != "tied_head"]
    with (
        recording(floats, [*linears, "norm"]) as seen_f,
        recording(quant, [*linears, "norm"]) as seen_q,
    ):
        logits_f, logits_q = (
            step_logits(engines["none"], tokens),
            step_logits(engines[method], tokens),
        )
    out = {}
    for name in [*linears, "logits"]:
        if name == "logits":
            (x_f, y_f), (x_q, y_q) = (seen_f["norm"][1], logits_f), (seen_q["norm"][1], logits_q)
            w, wq = float_weight(floats, "tied_head"), dequantize(layers["tied_head"].weight)
        else:
            (x_f, y_f), (x_q, y_q) = seen_f[name], seen_q[name]
            w, wq = float_weight(floats, name), dequantize(layers[name].weight)
            # in the model too, the kernel multiplies its own input by Wq (to summation order)
            assert ((y_q - F.linear(x_q, wq)).abs() <= rounding(x_q, wq)).all(), name
        dx = (x_q - x_f).norm(dim=1, keepdim=True)
        bound = dx * w.norm(dim=1) + x_q.norm(dim=1, keepdim=True) * (w - wq).norm(dim=1)
        bound += rounding(x_q, wq) + rounding(x_f, w)
        out[name] = torch.stack(((y_q - y_f).abs(), bound))
    first = linears[0]
    assert torch.equal(seen_f[first][0], seen_q[first][0])  # float embedding and norm in both
    return out


@pytest.mark.parametrize("method", list(METHODS))
def test_every_layer_and_the_logits_stay_within_the_bound_of_the_weight_error(
    engines, method
) -> None:
    tokens = prompts(engines["none"].model_config.vocab_size, [48], seed=7)[0]
    bounds = layer_bounds(engines, method, tokens)
    assert len(bounds) == 9
    for name, (diff, bound) in bounds.items():
        assert (diff <= bound).all(), (name, (diff - bound).max().item())
        assert diff.max() > 0, name
    diff, bound = bounds["logits"]
    # the bound is a bound, not a blanket: within two orders of magnitude of what happens
    assert bound.max() < 100 * diff.max()


def test_int8_greedy_tokens_equal_float32_where_the_margin_exceeds_the_bound(engines) -> None:
    vocab = engines["none"].model_config.vocab_size
    batch = prompts(vocab, [3, 9, 17, 30], seed=11)
    n = 16
    want = [o.new_token_ids for o in engines["none"].generate(batch, greedy(n))]
    got = [o.new_token_ids for o in engines["int8"].generate(batch, greedy(n))]
    checked = 0
    for prompt, w, g in zip(batch, want, got, strict=True):
        tokens = prompt + w
        _, bound = layer_bounds(engines, "int8", tokens)["logits"]
        top = step_logits(engines["none"], tokens).topk(2, dim=-1).values
        margin = (top[:, 0] - top[:, 1])[len(prompt) - 1 : -1]  # [n]: before each new token
        sure = margin > 2 * bound.amax(dim=1)[len(prompt) - 1 : -1]
        first_unsure = int(sure.logical_not().nonzero()[0]) if not sure.all() else n
        assert g[:first_unsure] == w[:first_unsure]
        checked += first_unsure
    assert checked >= 3 * len(batch) * n // 4, f"only {checked} positions had a clear margin"
    for e in engines.values():
        assert e.block_manager.num_used_blocks == 0
