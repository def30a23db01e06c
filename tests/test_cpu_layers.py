"""A decode step's layers in one C call (engine/cpu_layers.py): the Python layers' bits, or not
taken at all.

- A decode step's hidden states through the C loop equal the Python layers' bit for bit, alone
  and in batches, on llama (no biases) and qwen2 (q/k/v biases) shapes, int4 and int8 weights.
- Whole generations (no prefix cache, so both runs compute the same steps) give the same tokens
  and logprobs with the loop on and off; every block is freed.
- Models and steps it does not take go through Python: float32 activations, q/k norms
  (qwen3), an int8 KV cache, a step with a prompt in it.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from tests.engine_util import greedy, make_engine, prompts


def engine(path, **kw: object) -> LLMEngine:
    kw.setdefault("quantization", "int4")
    return make_engine(path, block_size=4, num_blocks=256, prefix_caching=False, **kw)


def decode_step(e: LLMEngine, batch: int):
    """``batch`` prompts prefilled, the next step (decode rows only) prepared."""
    params = greedy(1000)
    for i, p in enumerate(prompts(e.model_config.vocab_size, [3, 9, 17, 30][:batch], seed=5)):
        e.add_request(f"r{i}", p, params)
    while any(not s.is_decoding for s in e.scheduler.running) or e.scheduler.waiting:
        e.step()
    step = e.scheduler.schedule()
    assert all(n == 1 for n in step.num_new_tokens)
    return e.runner.prepare(step.seqs, step.num_new_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_decode_step_is_the_python_layers_bit_for_bit(model_dirs, arch, quantization) -> None:
    for batch in (1, 2, 4):
        e = engine(model_dirs[arch], quantization=quantization)
        runner = e.runner
        assert runner.native is not None
        inputs = decode_step(e, batch)
        runner.backend.plan(inputs.metadata)
        planned = runner.backend.native_decode()
        assert planned is not None
        native = runner.native.run(inputs.input_ids, inputs.positions, *planned)
        runner.backend.plan(inputs.metadata)  # the same slots written again, the same values
        python = runner.model(inputs.input_ids, inputs.positions, runner.kv_cache.layers,
                              runner.backend)  # fmt: skip
        assert torch.equal(native, python), (arch, quantization, batch)


def test_generations_are_the_same_with_the_loop_on_and_off(tiny_dir) -> None:
    e = engine(tiny_dir)
    batch = prompts(e.model_config.vocab_size, [1, 6, 17, 40], seed=9)
    params = greedy(12, logprobs=2)
    native = e.generate(batch, params)
    loop, e.runner.native = e.runner.native, None
    python = e.generate(batch, params)
    assert loop is not None
    for a, b in zip(native, python, strict=True):
        assert a.new_token_ids == b.new_token_ids and a.new_logprobs == b.new_logprobs
    assert e.status.num_free_blocks == e.status.num_blocks


def test_what_it_does_not_take_goes_through_python(model_dirs, tiny_dir) -> None:
    assert engine(tiny_dir, quant_activations="float32").runner.native is None
    assert engine(tiny_dir, quantization="none").runner.native is None
    assert engine(model_dirs["qwen3"]).runner.native is None  # q/k norms
    cache = CacheConfig(block_size=4, num_blocks=64, kv_cache_dtype="int8")
    int8_kv = LLMEngine(EngineConfig(model=str(tiny_dir), quantization="int4", cache=cache))
    assert int8_kv.runner.native is None
    e = engine(tiny_dir)
    inputs = decode_step(e, 2)
    e.runner.backend.plan(inputs.metadata)
    assert e.runner.backend.native_decode() is not None
    fresh = engine(tiny_dir)
    fresh.add_request("p", prompts(fresh.model_config.vocab_size, [7], seed=3)[0], greedy(2))
    step = fresh.scheduler.schedule()  # the prompt's own step
    assert step.num_new_tokens == [7]
    fresh.runner.backend.plan(fresh.runner.prepare(step.seqs, step.num_new_tokens).metadata)
    assert fresh.runner.backend.native_decode() is None
