"""``--kv-cache-dtype int8`` end to end in one process: the flag and its errors, the cache's
sizing, prefill → KV transfer → decode giving a colocated int8 engine's tokens with every block
freed, the prefix cache, and workers of different KV dtypes refused as partners."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from pdserve.coordinator.registry import register_problem
from pdserve.engine.block_manager import KVCache
from pdserve.engine.cli_args import add_engine_args, engine_config_from_args
from pdserve.engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer.base import LayoutMismatchError, check_layouts
from pdserve.launch.serve import add_serve_args
from pdserve.launch.worker_commands import worker_commands
from pdserve.protocol import messages as m
from pdserve.worker.wire import block_bytes, kv_layout
from tests.cluster_util import Cluster
from tests.engine_util import greedy, prompts, run_all

GREEDY = m.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")


def int8_engine(path: Path, kv: str = "int8", chunk: int = 2048, **cache: object) -> LLMEngine:
    """tests.engine_util.make_engine's engine (block size 4, 512 blocks) with ``kv`` KV, prompts
    in chunks of ``chunk`` tokens, no start-up step timing (a second an engine here)."""
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            cache=CacheConfig(
                **{"block_size": 4, "num_blocks": 512, **cache},  # type: ignore[arg-type]
                kv_cache_dtype=kv,
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_step_time_s=0),
        )
    )


def smollm_shape() -> ModelConfig:
    """SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64."""
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            **{"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536},
            **{"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3},
        }
    )


# ---- flag, config, sizing ----------------------------------------------------------------------


def test_flag_reaches_every_worker_and_bad_values_are_refused(tiny_dir, capsys) -> None:
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    args = serve.parse_args(["--model=tiny", "--kv-cache-dtype=int8", "--decode=2"])
    commands = worker_commands(args, "tcp://127.0.0.1:1", "/models/tiny")
    assert [c[1] for c in commands] == ["prefill", "decode", "decode"]
    assert all("--kv-cache-dtype=int8" in c for c in commands)
    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    config = engine_config_from_args(
        engine.parse_args([f"--model={tiny_dir}", "--kv-cache-dtype=int8"])
    )
    assert config.cache.kv_cache_dtype == "int8"
    assert engine.parse_args([]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        engine.parse_args(["--kv-cache-dtype", "fp8"])
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype: invalid choice: 'fp8'" in err and "int8" in err
    with pytest.raises(ConfigError, match=r"kv_cache_dtype must be auto or int8, got 'int4'"):
        CacheConfig(kv_cache_dtype="int4")


def test_same_budget_holds_3_76x_the_blocks() -> None:
    """4 D / (D + 4) at D = 64: each row's float32 scale costs 4 of its 68 bytes."""
    cfg = smollm_shape()
    budget = 1 << 30
    blocks = {
        kv: KVCache.num_blocks_for(
            cfg, CacheConfig(kv_cache_memory=budget, kv_cache_dtype=kv), torch.float32, CPU
        )
        for kv in ("auto", "int8")
    }
    assert KVCache.bytes_per_block(cfg, 16, torch.float32, "int8") == 30 * 2 * 16 * 3 * 68
    assert blocks == {"auto": budget // (30 * 2 * 16 * 3 * 64 * 4), "int8": budget // 195840}
    assert blocks["int8"] / blocks["auto"] >= 3.76  # 5,482 blocks against 1,456
    # against bf16: 2 D / (D + 4)
    bf16 = KVCache.num_blocks_for(cfg, CacheConfig(kv_cache_memory=budget), torch.bfloat16, CPU)
    assert 1.87 <= blocks["int8"] / bf16 <= 1.89
    cache = KVCache.create(  # its memory is taken as blocks are written: none here
        cfg, CacheConfig(kv_cache_memory=budget, kv_cache_dtype="int8"), torch.float32, CPU
    )
    assert cache.layers[0].dtype == torch.int8 and cache.layers[0].shape[1:] == (2, 16, 3, 68)
    assert cache.nbytes == blocks["int8"] * 195840 <= budget


def test_int8_is_cpu_only_eager_and_single_rank() -> None:
    int8 = CacheConfig(num_blocks=4, kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="int8 KV cache is CPU-only for now"):
        KVCache.create(smollm_shape(), int8, torch.float32, torch.device("cuda"))
    with pytest.raises(ConfigError, match="int8 KV cache is CPU-only for now"):
        EngineConfig(model="m", device="cuda:0", cache=int8)
    for kw in ({"compile": True}, {"tensor_parallel_size": 2}):
        with pytest.raises(ConfigError, match="not run with --compile or in a tensor-parallel"):
            EngineConfig(model="m", cache=int8, **kw)  # type: ignore[arg-type]


# ---- through the cluster ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_disaggregated_int8_equals_colocated_int8(tiny_dir, backend) -> None:
    batch = prompts(512, [1, 7, 12, 33, 60])
    alone = int8_engine(tiny_dir)
    want = [o.new_token_ids for o in alone.generate(batch, greedy(10))]
    prefill = int8_engine(tiny_dir, chunk=32)  # prompts over chunks: written, then read back
    cluster = Cluster([prefill], [int8_engine(tiny_dir)], backend)
    try:
        for i, p in enumerate(batch):
            cluster.submit(f"r{i}", p, GREEDY)
        cluster.pump()
        assert [cluster.tokens(f"r{i}")[0] for i in range(len(batch))] == want
        assert set(cluster.used_blocks().values()) == {0}
        sent = cluster.workers["p0"].transfers  # type: ignore[union-attr]
        # the int8 rows as they are: 2 layers x K/V x 4 tokens x 2 heads x (16 + 4) bytes
        assert block_bytes(prefill) == 2 * 2 * 4 * 2 * 20
        assert sent.bytes == sent.blocks * block_bytes(prefill) > 0
    finally:
        cluster.close()


def test_prefix_cache_keeps_int8_blocks(tiny_dir) -> None:
    engine = int8_engine(tiny_dir)
    prompt = prompts(512, [40], seed=5)[0]
    first = engine.generate([prompt], greedy(6))[0]
    engine.add_request("again", prompt, greedy(6))
    again = run_all(engine)["again"]
    assert again.num_cached_tokens == 36 and again.new_token_ids == first.new_token_ids
    assert engine.block_manager.num_used_blocks == 0


def test_workers_of_different_kv_dtypes_never_pair(tiny_dir) -> None:
    floats, int8 = int8_engine(tiny_dir, "auto"), int8_engine(tiny_dir)
    layout = kv_layout(int8)
    assert (layout.dtype, layout.head_dim) == ("int8", 20)  # a row's bytes: 16 values, a scale
    with pytest.raises(LayoutMismatchError, match=r"pass the same --kv-cache-dtype"):
        check_layouts(kv_layout(floats), layout, ("prefill p0", "decode d0"))
    cluster = Cluster([floats], [int8])
    try:
        assert list(cluster.coordinator.registry.workers) == ["p0"]  # d0 refused
    finally:
        cluster.close()


def test_coordinator_accepts_an_int8_layout(tiny_dir) -> None:
    from pdserve.protocol.control import Register

    engine = int8_engine(tiny_dir)
    info = Register(
        role="decode",
        worker_id="d0",
        model="tiny",
        control_address="inproc://d0",
        transfer_address="tcp://127.0.0.1:1",
        transfer_backend="zmq",
        layout=kv_layout(engine),
        num_blocks=engine.block_manager.num_blocks,
        model_root="/models/tiny",
        max_model_len=engine.max_model_len,
    )
    assert register_problem(info) is None
