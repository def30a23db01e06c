"""Quantized weights end to end: disaggregated = colocated = single engine, token for token,
in every mode, with every block freed after.

Modes: int8, int4 (group 32) of the tiny model, and gguf: a pulled Q4_1 / Q8_0 GGUF of it,
served as it is (--quantization auto).

- Every mode, in one process (tests/cluster_util.py: the real coordinator and workers, every
  message msgpack-encoded, KV over the real zmq transfer on loopback): disaggregated (a
  prefill worker that chunks prompts by 16 tokens, a decode worker) and colocated (one worker
  runs both phases), each against the single engine; every engine's blocks all free.
- Real processes, one mode: ``pdserve serve --quantization int4 --quant-group-size 32``
  (1 prefill + 1 decode): the flags reach both workers, the tokens over HTTP are the single
  engine's, every block is freed. Not every mode: one cluster of processes serving all three
  (coordinator, gateway, a prefill, a decode and a colocated worker per mode: 11 torch
  imports) took 126 s on the shared 2-core machine; what differs between modes is all in the
  engine, which the in-process clusters run for every mode.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import httpx
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.tokenizer import Tokenizer
from pdserve.models.pull import pull_model
from pdserve.protocol import messages as m
from tests.cluster_util import Cluster
from tests.e2e_util import ServedCluster
from tests.engine_util import greedy, prompts

LENGTHS = [1, 6, 17, 40]  # prompt tokens: within one block, and over several (block size 16)
MAX_TOKENS = 12
SPEC = m.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pulled(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as the real one is pulled: Q4_1 matrices, a Q8_0 tied embedding, F32
    norms, model.gguf kept beside the float files (as tests/test_gguf_weights.py's)."""
    from tests.test_gguf import write_gguf

    home = tmp_path_factory.mktemp("home")
    q = gguf.GGMLQuantizationType
    path = write_gguf(tiny_dir, home / "tiny-q.gguf", q.Q4_1, {"token_embd.weight": q.Q8_0})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_HOME", str(home))
        return pull_model(str(path))


@pytest.fixture(scope="module")
def modes(tiny_dir: Path, pulled: Path) -> dict[str, tuple[Path, str, int]]:
    """mode -> (model directory, quantization, group size)."""
    return {
        "int8": (tiny_dir, "int8", 32),
        "int4-g32": (tiny_dir, "int4", 32),
        "gguf Q4_1+Q8_0": (pulled, "auto", 32),
    }


def engine(
    path: Path, quantization: str, group: int, chunk: int = 2048, activations: str = "auto"
) -> LLMEngine:
    """An engine over ``path`` in the mode; no start-up step timing (a fixed step budget)."""
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            quantization=quantization,
            quant_group_size=group,
            quant_activations=activations,
            cache=CacheConfig(block_size=16, num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_step_time_s=0),
        )
    )


@pytest.mark.parametrize("activations", ["float32", "int16", "int8"])
@pytest.mark.parametrize("mode", ["int8", "int4-g32", "gguf Q4_1+Q8_0"])
def test_disaggregated_and_colocated_equal_the_single_engine(modes, mode, activations) -> None:
    path, quantization, group = modes[mode]
    single = engine(path, quantization, group, activations=activations)
    label = mode if activations == "float32" else f"{mode}, {activations} activations"
    assert single.runner.model.quantization == label
    batch = prompts(single.model_config.vocab_size, LENGTHS, seed=27)
    want = [out.new_token_ids for out in single.generate(batch, greedy(MAX_TOKENS))]
    assert single.block_manager.num_used_blocks == 0
    disagg = Cluster(
        [engine(path, quantization, group, chunk=16, activations=activations)],
        [engine(path, quantization, group, activations=activations)],
    )
    colocated = Cluster(
        [], [engine(path, quantization, group, activations=activations)], colocated=True
    )
    for cluster, route in ((disagg, "disaggregated"), (colocated, "colocated")):
        try:
            for i, prompt in enumerate(batch):
                cluster.submit(f"r{i}", prompt, SPEC)
            cluster.pump()
            assert [cluster.tokens(f"r{i}") for i in range(len(batch))] == [{0: w} for w in want], (
                route
            )
            assert cluster.coordinator.decisions == {route: len(batch)}
            assert cluster.coordinator.routes == {}
            assert set(cluster.used_blocks().values()) == {0}, route
            for w in cluster.workers.values():
                assert w.engine.runner.model.quantization == label
        finally:
            cluster.close()


def test_served_int4_equals_the_single_engine_and_frees_every_block(tiny_dir) -> None:
    flags = ("--quantization=int4", "--quant-group-size=32", "--num-kv-blocks=64")
    c = ServedCluster(tiny_dir, *flags, "--max-step-time=0")
    try:
        single = engine(tiny_dir, "int4", 32)
        tok = Tokenizer.from_dir(tiny_dir)
        for prompt in prompts(single.model_config.vocab_size, LENGTHS, seed=28):
            (want,) = single.generate([prompt], greedy(MAX_TOKENS))
            r = httpx.post(
                f"{c.url}/v1/completions",
                timeout=60,
                json={
                    "model": c.model_name,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tok.decode(want.new_token_ids)
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        used = c.wait_blocks_free()
        assert len(used) == 2 and set(used.values()) == {0.0}, used
        # both workers loaded the int4 weights (each logs its model's quantization once)
        assert c.output().count("weights int4-g32") == 2
    finally:
        c.stop()
