"""Rope in one C call, in place (engine/cpu_rope.py): bit for bit the torch ops it replaces, on
odd shapes and strided rows; torch's own path for what it does not take; a model's logits
identical with it on and off."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdserve.engine import cpu_rope, rope
from pdserve.engine.cpu_rope import rotate_in_place
from pdserve.engine.rope import apply_rotary
from tests.engine_util import greedy, make_engine, prompts


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    """Never skipped: `make test` installs a C compiler, so a kernel that did not build, or
    does not match torch here, fails."""
    if cpu_rope.kernel() is None:
        pytest.fail("the rope C kernel did not build or differs from torch (see the log)")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


@pytest.mark.parametrize("rows", [1, 2, 7, 33, 80])  # 80: spread over threads
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (2, 2, 128), (3, 1, 6)]
)
def test_rope_in_the_qkv_rows_equals_torch_bitwise(
    rows: int, heads: int, kv_heads: int, dim: int
) -> None:
    qkv = _randn(rows, (heads + 2 * kv_heads) * dim, seed=rows * dim + heads) * 4
    cos, sin = _randn(rows, 1, dim, seed=1), _randn(rows, 1, dim, seed=2)
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim)  # strided rows, as the model's
    expected = _torch_rope(qk, cos, sin)
    v = qkv[:, (heads + kv_heads) * dim :].clone()
    out = apply_rotary(qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v)  # V untouched
    contiguous = qk.clone()  # as torch.cat's output, the q/k-norm models' case
    assert torch.equal(apply_rotary(contiguous, cos, sin), _torch_rope(qk, cos, sin))


def test_what_the_kernel_does_not_take_runs_through_torch(monkeypatch) -> None:
    cos, sin = _randn(3, 1, 16, seed=1), _randn(3, 1, 16, seed=2)
    x = _randn(3, 4, 16, seed=3)
    for other in (
        x.bfloat16(),  # not float32
        x.transpose(1, 2).contiguous().transpose(1, 2),  # a head's values not adjacent
        x[:, :, :15],  # odd head size
    ):
        kept = other.clone()
        c, s = cos[..., : other.shape[-1]].to(other.dtype), sin[..., : other.shape[-1]]
        out = apply_rotary(other, c, s.to(other.dtype))
        assert torch.equal(other, kept)  # not written in place
        assert torch.equal(out, _torch_rope(kept, c, s.to(other.dtype)))
    assert not rotate_in_place(x, cos[..., :8], sin)  # cos of another size
    assert not rotate_in_place(x, cos.repeat(1, 1, 2)[..., ::2], sin)  # cos not contiguous
    assert not rotate_in_place(x[:1].expand(3, 4, 16), cos, sin)  # rows that overlap
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced: torch ops
    assert not rotate_in_place(x.clone(), cos, sin)


@pytest.mark.parametrize("failure", ["no library", "differs from torch"])
def test_without_a_kernel_that_matches_torch_rope_runs_through_torch(
    monkeypatch, failure: str
) -> None:
    if failure == "no library":
        monkeypatch.setattr(cpu_rope, "open_library", lambda *args: None)
    else:
        monkeypatch.setattr(cpu_rope, "_matches_torch", lambda fn, fma: False)
    cpu_rope.kernel.cache_clear()
    try:
        assert cpu_rope.kernel() is None
        x, cos, sin = _randn(2, 3, 16, seed=1), _randn(2, 1, 16, seed=2), _randn(2, 1, 16, seed=3)
        kept = x.clone()
        assert torch.equal(apply_rotary(x, cos, sin), _torch_rope(kept, cos, sin))
        assert torch.equal(x, kept)  # a new tensor, x untouched
    finally:
        cpu_rope.kernel.cache_clear()  # the next caller builds (finds) and checks it again


def _both_ways(runner: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable:
    """``runner.execute`` running each step with torch's rope, then again (the same KV slots
    written over) with the C one, keeping both logits."""
    execute = runner.execute

    def run(inputs: Any) -> torch.Tensor:
        runner.model.use_native_rope(False)
        reference = execute(inputs)
        runner.model.use_native_rope(True)
        pairs.append((execute(inputs), reference))
        return pairs[-1][0]

    return run


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms, rope after a cat
def test_model_logits_identical_with_the_native_rope_on_and_off(
    model_dirs, arch: str, monkeypatch
) -> None:
    ran = []
    native_rope = rope.rotate_in_place

    def counted(*args: torch.Tensor) -> bool:
        ran.append(native_rope(*args))
        return ran[-1]

    monkeypatch.setattr(rope, "rotate_in_place", counted)
    # a 16-token budget: prompt chunks, then steps of prefill and decode rows together
    engine = make_engine(model_dirs[arch], max_num_batched_tokens=16)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    monkeypatch.setattr(engine.runner, "execute", _both_ways(engine.runner, pairs))
    engine.generate(prompts(engine.model_config.vocab_size, [1, 7, 33], seed=3), greedy(4))
    assert len(pairs) > 4 and len(ran) >= len(pairs) * engine.model_config.num_layers
    assert all(ran)  # every native call took its tensors
    for native, reference in pairs:
        assert torch.equal(native, reference)


def test_a_meta_built_table_is_left_for_the_materialised_one(monkeypatch) -> None:
    """Built on the meta device, a rotary holds shapes only (the loader builds the real one
    after ``to_empty``): a 128k-position table cost 0.15 s of every start, thrown away."""
    config = rope.RopeConfig()
    calls: list[int] = []
    real = rope.inverse_frequencies
    monkeypatch.setattr(rope, "inverse_frequencies", lambda *a: calls.append(1) or real(*a))
    with torch.device("meta"):
        meta = rope.RotaryEmbedding(config, 16, 4096)
    assert calls == [] and meta.cos.is_meta and meta.cos.shape == (4096, 16)
    assert meta.sin_signed.shape == (4096, 16) and meta.cos.dtype == torch.float32
    built = rope.RotaryEmbedding(config, 16, 4096)
    assert calls == [1] and built.cos.device.type == "cpu"
    moved = meta.to_empty(device="cpu")
    assert moved.cos.shape == built.cos.shape and moved.cos.dtype == built.cos.dtype
