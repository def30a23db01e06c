"""``--compile`` (engine/compile.py): decode steps through torch.compile give the eager tokens.

One compiled engine for the whole module: its start-up builds both graphs (batch 1, batch 2+),
which is nearly all of this file's time, so the model is the tiny preset cut to one layer
(the compiler's fixed cost dominates; each layer adds seconds on 2 cores).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdserve.engine import compile as compile_mod
from pdserve.engine.attention import AttentionBackend
from pdserve.engine.cli_args import add_engine_args, engine_config_from_args
from pdserve.engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.models.make_model import PRESETS, Preset, make_model
from pdserve.protocol.sampling import SamplingParams
from tests.engine_util import greedy, prompts

ONE_LAYER = Preset(64, 128, 1, 4, 2, 16, 2048, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "one-layer", ONE_LAYER)
        return Path(make_model(tmp_path_factory.mktemp("one-layer"), preset="one-layer"))


def engine_config(path: Path, compile: bool) -> EngineConfig:
    # block size 4: a few tokens cross blocks; no prefix cache, so every prompt token is
    # computed and each step's kind (prefill, decode) follows from the prompts alone
    return EngineConfig(
        model=str(path),
        dtype="float32",
        compile=compile,
        cache=CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_step_time_s=0),
    )


def graphs_built() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def record_compiled_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A list that gets, per step of ``engine`` (compiled), True when the graph ran it."""
    compiled = engine.runner.compiled
    real = compiled.run
    steps: list[bool] = []

    def run(*args: object) -> torch.Tensor | None:
        hidden = real(*args)
        steps.append(hidden is not None)
        return hidden

    monkeypatch.setattr(compiled, "run", run)
    return steps


@pytest.fixture(scope="module")
def engines(one_layer_dir: Path) -> SimpleNamespace:
    eager = LLMEngine(engine_config(one_layer_dir, compile=False))
    before = graphs_built()
    compiled = LLMEngine(engine_config(one_layer_dir, compile=True))
    return SimpleNamespace(
        eager=eager, compiled=compiled, warm_up_graphs=graphs_built() - before, after=graphs_built()
    )


@pytest.fixture
def compiled_steps(engines: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[list]:
    """Per step of the compiled engine: True when the graph ran it, False when it ran eagerly.
    Serving never builds a graph beyond the two of the warm-up (checked after each test)."""
    yield record_compiled_steps(engines.compiled, monkeypatch)
    assert graphs_built() == engines.after, "a step recompiled"


def both(engines: SimpleNamespace, batch: list[list[int]], params: SamplingParams) -> tuple:
    return engines.eager.generate(batch, params), engines.compiled.generate(batch, params)


def assert_same(eager: list[RequestOutput], compiled: list[RequestOutput]) -> None:
    for e, c in zip(eager, compiled, strict=True):
        assert c.new_token_ids == e.new_token_ids
        assert len(c.new_logprobs) == len(e.new_logprobs)
        for le, lc in zip(e.new_logprobs, c.new_logprobs, strict=True):
            assert [t for t, _ in lc.top] == [t for t, _ in le.top]
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in lc.top]),
                torch.tensor([lp for _, lp in le.top]),
                atol=1e-5,
                rtol=0,
            )


def test_warm_up_builds_the_two_graphs(engines: SimpleNamespace) -> None:
    assert engines.compiled.runner.compiled is not None
    assert engines.eager.runner.compiled is None
    assert engines.warm_up_graphs == 2  # batch 1, and every larger batch (dynamic shapes)


def test_decode_steps_run_compiled_with_the_eager_tokens(
    engines: SimpleNamespace, compiled_steps: list[bool]
) -> None:
    # 6 to 14 tokens of context (2 to 4 blocks): one decode group, so every decode step
    # after the prefill step runs in the graph
    batch = prompts(engines.eager.model_config.vocab_size, [5, 6, 7], seed=0)
    eager, compiled = both(engines, batch, greedy(8, logprobs=2))
    assert_same(eager, compiled)
    assert compiled_steps == [False] + [True] * 7
    assert [o.finish_reason for o in compiled] == ["length"] * 3


def test_one_sequence_runs_the_batch_one_graph(
    engines: SimpleNamespace, compiled_steps: list[bool]
) -> None:
    batch = prompts(engines.eager.model_config.vocab_size, [9], seed=1)
    eager, compiled = both(engines, batch, greedy(6, logprobs=2))
    assert_same(eager, compiled)
    assert compiled_steps == [False] + [True] * 5


def test_seeded_sampling_draws_the_same_tokens(
    engines: SimpleNamespace, compiled_steps: list[bool]
) -> None:
    """Sampling reads the whole distribution, not just its top: the same seed draws the same
    tokens from compiled logits as from eager ones (batches 4 then fewer as rows finish)."""
    batch = prompts(engines.eager.model_config.vocab_size, [4, 5, 6, 8], seed=2)
    params = [
        SamplingParams(max_tokens=n, temperature=1.0, seed=7 + n, ignore_eos=True)
        for n in (3, 5, 7, 9)
    ]
    eager, compiled = both(engines, batch, params)
    assert [o.new_token_ids for o in compiled] == [o.new_token_ids for o in eager]
    assert [len(o.new_token_ids) for o in compiled] == [3, 5, 7, 9]
    assert compiled_steps == [False] + [True] * 8


def test_steps_that_are_not_decode_only_run_eagerly(
    engines: SimpleNamespace, compiled_steps: list[bool]
) -> None:
    # step 1 prefills 40 tokens beside a 1-token prompt (mixed); later steps decode rows of
    # 1 and 11 blocks, two groups: none of them is one decode group, so none is compiled
    batch = prompts(engines.eager.model_config.vocab_size, [1, 40], seed=3)
    eager, compiled = both(engines, batch, greedy(4, logprobs=2))
    assert_same(eager, compiled)
    assert compiled_steps == [False] * 4


def test_a_backend_other_than_torch_runs_eagerly(engines: SimpleNamespace) -> None:
    class Other(AttentionBackend):
        def plan(self, metadata: object) -> None:
            raise AssertionError("not planned by run")

        def forward(self, *args: object) -> torch.Tensor:
            raise AssertionError("not called by run")

    ids = torch.zeros(1, dtype=torch.long)
    assert engines.compiled.runner.compiled.run(ids, ids, Other()) is None


def test_no_cpp_compiler_is_a_config_error(
    one_layer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compile_mod, "shutil", SimpleNamespace(which=lambda name: None))
    with pytest.raises(ConfigError) as e:
        LLMEngine(engine_config(one_layer_dir, compile=True))
    assert str(e.value) == "--compile needs a C++ compiler (g++) for inductor's CPU kernels"


def test_compile_is_refused_off_cpu(one_layer_dir: Path) -> None:
    with pytest.raises(ConfigError) as e:
        EngineConfig(model=str(one_layer_dir), device="cuda:0", compile=True)
    assert str(e.value) == (
        "compile is for CPU decode steps (CUDA ones use CUDA graphs), device is 'cuda:0'"
    )


def test_the_flag_reaches_the_engine_config(one_layer_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    off = engine_config_from_args(parser.parse_args(["--model", str(one_layer_dir)]))
    on = engine_config_from_args(parser.parse_args(["--model", str(one_layer_dir), "--compile"]))
    assert (off.compile, on.compile) == (False, True)
    assert on.model == str(one_layer_dir)
