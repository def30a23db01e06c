"""``--compile`` with quantized weights: the decode graph calls the kernel as the custom op
``pdserve::qlinear`` (engine/quant/linear.py) and gives the eager engine's tokens.

Slow like tests/test_compile.py (its one-layer model): building the two graphs is nearly all of
this file's time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.quant.linear import QuantLinear
from tests.engine_util import greedy, prompts
from tests.test_compile import one_layer_dir, record_compiled_steps  # noqa: F401 - fixture


def config(path: Path, compile: bool, activations: str) -> EngineConfig:
    return EngineConfig(
        model=str(path),
        dtype="float32",
        compile=compile,
        quantization="int4",
        quant_activations=activations,
        cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_step_time_s=0),
    )


@pytest.mark.parametrize("activations", ["float32", "int16"])
def test_compiled_decode_steps_give_the_eager_tokens(
    one_layer_dir: Path,  # noqa: F811 - test_compile's fixture, imported above
    monkeypatch: pytest.MonkeyPatch,
    activations: str,
) -> None:
    """The kernels as custom ops in the compiled graphs: pdserve::qlinear, pdserve::qdot."""
    eager = LLMEngine(config(one_layer_dir, compile=False, activations=activations))
    compiled = LLMEngine(config(one_layer_dir, compile=True, activations=activations))
    model = compiled.runner.model
    label = "int4-g32" if activations == "float32" else f"int4-g32, {activations} activations"
    assert model.quantization == label and isinstance(model.tied_head, QuantLinear)
    steps = record_compiled_steps(compiled, monkeypatch)
    batch = prompts(eager.model_config.vocab_size, [5, 6, 7], seed=0)
    want = eager.generate(batch, greedy(8, logprobs=2))
    got = compiled.generate(batch, greedy(8, logprobs=2))
    assert steps == [False] + [True] * 7  # the prefill eagerly, every decode step compiled
    for e, c in zip(want, got, strict=True):
        assert c.new_token_ids == e.new_token_ids
        for le, lc in zip(e.new_logprobs, c.new_logprobs, strict=True):
            assert [t for t, _ in lc.top] == [t for t, _ in le.top]
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in lc.top]),
                torch.tensor([lp for _, lp in le.top]),
                atol=1e-5,
                rtol=0,
            )
    assert compiled.status.num_free_blocks == compiled.status.num_blocks
