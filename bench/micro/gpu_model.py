"""gpu.py's model rows: the card's limits, a random bf16 engine with Llama-3-8B's shapes
(decode MBU, prefill MFU, host syncs), and transformers beside it.

The 8B model is built on the GPU in memory (random weights, std 0.02); only its config.json
touches the disk, so the engine can read it. NOT yet run on a GPU.
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any  # config.json's fields (LLAMA3_8B)
from unittest import mock

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model import CausalLM
from pdserve.engine.rope import RotaryEmbedding
from pdserve.engine.scheduler import RequestId
from pdserve.protocol.sampling import SamplingParams

DEV = torch.device("cuda")
# config.json's fields, values of every JSON type (also ``LlamaConfig``'s keyword arguments)
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
DECODE_CONTEXT = 1024  # prompt tokens of each decode row
PREFILL_TOKENS = 4096
HF_PROMPT, HF_OUTPUT = 512, 128


def timed(fn: Callable[[], object], iters: int = 10) -> float:
    """Seconds per call on the GPU (after two warm-up calls), by CUDA events."""
    for _ in range(2):
        fn()
    # torch.cuda.Event's __init__ is unannotated
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    ms: float = start.elapsed_time(end)  # its result is unannotated too
    return ms / 1e3 / iters


def peaks(work: dict[str, float]) -> dict[str, str]:
    """Copy bandwidth (DRAM traffic: read + write) and the bf16 matmul rate."""
    size = 2 * 2**30
    t = _copy_seconds(size)
    work["copy_rate"] = size / t  # bytes copied per second
    work["dram_bw"] = 2 * size / t  # bytes read + written per second
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEV)
    work["matmul"] = 2 * n**3 / timed(lambda: a @ b)
    return {
        "copy_bw": f"{work['dram_bw'] / 1e9:.0f} GB/s read+write ({work['copy_rate'] / 1e9:.0f} "
        "GB/s copied)",
        "matmul": f"{work['matmul'] / 1e12:.0f} TFLOP/s ({n}^3 bf16)",
    }


def _copy_seconds(size: int) -> float:
    src = torch.empty(size, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src))


# ---- the 8B-shaped engine ------------------------------------------------------------------------


def _random_model(
    path: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    quantization: str = "auto",
    group_size: int = 32,
    layout: object = None,
) -> CausalLM:
    """Stands in for engine.loader.load_model (its signature): same shapes, random bf16 weights,
    on the GPU; ``dtype``, the quantization and a tensor-parallel ``layout`` (one process
    here) are not used."""
    cfg = ModelConfig.from_dir(path)
    max_positions = max_positions or cfg.max_position_embeddings
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    model = model.to_empty(device=device).to(torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions).to(device)
    return model.eval()


@contextmanager
def llama8b_engine(kv_bytes: int = 24 * 2**30) -> Iterator[LLMEngine]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA3_8B))
        config = EngineConfig(
            model=tmp,
            dtype="bfloat16",
            device="cuda",
            cache=CacheConfig(kv_cache_memory=kv_bytes, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=PREFILL_TOKENS),
        )
        with mock.patch("pdserve.engine.model_runner.load_model", _random_model):
            engine = LLMEngine(config)
        yield engine


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = LLAMA3_8B["vocab_size"]
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _decode_steps(engine: LLMEngine, batch: int, steps: int, seed: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps with ``batch`` rows of DECODE_CONTEXT tokens."""
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    ids = [f"d{seed}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, _prompts(batch, DECODE_CONTEXT, seed), strict=True):
        engine.add_request(rid, prompt, params)
    started: set[RequestId] = set()
    while len(started) < batch:  # prefill every row (several steps of 4,096 tokens)
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # ends in the sampler's host copy: the GPU work is done
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    engine.step()
    return times


def _host_syncs(engine: LLMEngine) -> int:
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(8, 64, 7)):
        engine.add_request(f"s{i}", prompt, params)
    for _ in range(4):
        engine.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for i in range(8):
        engine.abort(f"s{i}")
    engine.step()
    return sum("synchroniz" in str(w.message) for w in caught)


def llama8b_rows(work: dict[str, float]) -> dict[str, str]:
    rows, ours = _engine_rows(work["dram_bw"], work["matmul"])
    gc.collect()  # the engine is gone: its weights, KV cache and graphs make room for HF's
    torch.cuda.empty_cache()
    rows["transformers"] = _transformers_row(ours)
    return rows


def _engine_rows(dram_bw: float, matmul: float) -> tuple[dict[str, str], float]:
    rows: dict[str, str] = {}
    cfg = ModelConfig.from_dict(LLAMA3_8B)
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    with llama8b_engine() as engine:
        runner = engine.runner
        params = {n: p.numel() for n, p in runner.model.named_parameters()}
        weight_bytes = 2 * sum(n for name, n in params.items() if "embed_tokens" not in name)
        graphs = "graphs on" if runner.graphs is not None else "graphs OFF"
        mode = f"{runner.backend.name}, {graphs}"
        for batch in (1, 8, 64):
            step = statistics.median(_decode_steps(engine, batch, 32, seed=batch))
            kv = batch * (DECODE_CONTEXT + 24) * kv_per_token
            floor = (weight_bytes + kv) / dram_bw
            rows[f"decode_{batch}"] = (
                f"{step * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms, MBU {floor / step:.0%} "
                f"({batch * DECODE_CONTEXT}-token KV, {mode})"
            )
        rows["prefill"] = _prefill_row(engine, cfg, matmul)
        rows["syncs"] = f"{_host_syncs(engine)} (torch sync debug mode, batch 8, {mode})"
        return rows, _generate_seconds(engine)


def _prefill_row(engine: LLMEngine, cfg: ModelConfig, matmul: float) -> str:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    for prompt in _prompts(3, PREFILL_TOKENS, 11):  # the first one warms up (JIT, plans)
        start = time.perf_counter()
        engine.generate([prompt], params)
        times.append(time.perf_counter() - start)
    t = min(times[1:])
    tokens = PREFILL_TOKENS
    per_layer = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer += cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * (
        cfg.intermediate_size
    )
    linear = 2 * tokens * per_layer * cfg.num_layers + 2 * cfg.hidden_size * cfg.vocab_size
    attention = 2 * tokens * tokens * cfg.num_heads * cfg.head_dim * cfg.num_layers  # causal
    flops = linear + attention
    return f"{t * 1e3:.0f} ms, {flops / t / 1e12:.0f} TFLOP/s, MFU {flops / t / matmul:.0%}"


def _generate_seconds(engine: LLMEngine) -> float:
    params = SamplingParams(max_tokens=HF_OUTPUT, temperature=0.0, ignore_eos=True)
    engine.generate(_prompts(1, HF_PROMPT, 3), SamplingParams(max_tokens=4, temperature=0.0))
    start = time.perf_counter()
    engine.generate(_prompts(1, HF_PROMPT, 5), params)
    return time.perf_counter() - start


def _transformers_row(ours: float) -> str:
    theirs = _transformers_seconds()
    gc.collect()
    torch.cuda.empty_cache()
    return (
        f"{HF_OUTPUT / ours:.0f} vs {HF_OUTPUT / theirs:.0f} tok/s = {theirs / ours:.2f}x "
        f"(batch 1, {HF_PROMPT} + {HF_OUTPUT} tokens, random weights each)"
    )


def _transformers_seconds() -> float:
    """``generate`` of HF_OUTPUT tokens after a HF_PROMPT-token prompt, same shapes, bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "torch_dtype")}
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # parameters made in bf16, on the GPU
    try:
        with torch.device(DEV):
            model = LlamaForCausalLM(LlamaConfig(**fields))
            model.train(False)  # eval(), which transformers leaves unannotated
    finally:
        torch.set_default_dtype(before)
    ids = torch.tensor(_prompts(1, HF_PROMPT, 5), device=DEV)

    def generate(n: int) -> float:
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate(4)
    return generate(HF_OUTPUT)
