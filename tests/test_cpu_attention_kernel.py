"""The CPU decode attention kernel (engine/attention/cpu_decode.c) against the torch path and a
float64 reference on random paged caches (float32, bf16); its build cache; the torch fallback
(no compiler, a failed build, fp16)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, TorchAttentionBackend, cpu_kernel
from pdserve.engine.attention.cpu_kernel import KernelPlan, build, find_compiler, load_kernel

CPU = torch.device("cpu")


@pytest.fixture
def kernel() -> object:
    """The built kernel: `make test` installs a C compiler, so a failed build fails here."""
    k = load_kernel()
    assert k is not None, f"the CPU decode kernel did not build (compiler: {find_compiler()})"
    return k


needs_kernel = pytest.mark.usefixtures("kernel")


def make_step(query_lens, seq_lens, heads, kv_heads, dim, bs, dtype=torch.float32, seed=0):
    """Metadata, a cache with every context in shuffled blocks, and q/k/v as the model hands
    them over: strided views of one fused QKV row per token."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-s // bs) for s in seq_lens]
    perm = torch.randperm(sum(pages) + 3, generator=g).tolist()
    tables = [perm[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(pages))]
    slots = [
        t[p // bs] * bs + p % bs
        for q, s, t in zip(query_lens, seq_lens, tables, strict=True)
        for p in range(s - q, s)
    ]
    meta = AttentionMetadata(torch.tensor(slots), list(query_lens), list(seq_lens), tables, bs)
    cache = torch.randn(len(perm), 2, bs, kv_heads, dim, generator=g).to(dtype)
    t, hd, kd = len(slots), heads * dim, kv_heads * dim
    qkv = (2 * torch.randn(t, hd + 2 * kd, generator=g)).to(dtype)
    q = qkv[:, :hd].view(t, heads, dim)
    k = qkv[:, hd : hd + kd].view(t, kv_heads, dim)
    v = qkv[:, hd + kd :].view(t, kv_heads, dim)
    return meta, cache, (q, k, v)


def run(backend, meta, cache, qkv):
    cache = cache.clone()
    backend.plan(meta)
    with torch.inference_mode():
        return backend.forward(*qkv, cache, qkv[0].shape[2] ** -0.5), cache


def reference(meta, cache, qkv) -> torch.Tensor:
    """float64 attention of the last query row of each sequence, from the written cache."""
    q = qkv[0].double()
    out, start = [], 0
    for q_len, seq_len, table in zip(
        meta.query_lens_cpu, meta.seq_lens_cpu, meta.block_tables_cpu, strict=True
    ):
        kv = cache[table].double()  # [blocks, 2, bs, KV, D]
        k = kv[:, 0].flatten(0, 1)[:seq_len]  # [L, KV, D]
        v = kv[:, 1].flatten(0, 1)[:seq_len]
        qi = q[start + q_len - 1]  # [H, D]
        group = qi.shape[0] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,lhd->hl", qi, k) * q.shape[2] ** -0.5).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v))
        start += q_len
    return torch.stack(out)


RAGGED = [1, 15, 16, 17, 100, 1031]  # one token, block boundaries, past a chunk of 128


@needs_kernel
@pytest.mark.parametrize("lens", [[1], RAGGED, [64] * 8, [5, 300] * 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("dim", [16, 64, 128])  # 64 and 128 have their own unrolled loops
@pytest.mark.parametrize("bs", [4, 16])
def test_kernel_matches_torch_path_on_decode_rows(
    lens, heads, kv_heads, dim, bs, monkeypatch
) -> None:
    meta, cache, qkv = make_step([1] * len(lens), lens, heads, kv_heads, dim, bs)
    backend = TorchAttentionBackend(CPU)
    calls = spy_on_kernel(backend, monkeypatch)
    got, got_cache = run(backend, meta, cache, qkv)
    assert calls == [len(lens)]
    want, want_cache = run(TorchAttentionBackend(CPU, cpu_kernel=False), meta, cache, qkv)
    assert torch.equal(got_cache, want_cache)  # the same K/V writes
    assert (got - want).abs().max().item() <= 1e-5
    exact = reference(meta, got_cache, qkv)
    assert (got.double() - exact).abs().max().item() <= 5e-6


def spy_on_kernel(backend: TorchAttentionBackend, monkeypatch) -> list[int]:
    """Sequences per kernel call, recorded."""
    kernel, calls = backend._kernel, []
    assert kernel is not None
    real = kernel.run

    def run(q, kv_cache, plan, *args, **kw):
        calls.append(plan.num_seqs)
        return real(q, kv_cache, plan, *args, **kw)

    monkeypatch.setattr(kernel, "run", run)
    return calls


@needs_kernel
def test_kernel_threads_give_the_same_result() -> None:
    lens = [1000, 3, 17, 400, 64, 2, 129, 800]
    meta, cache, qkv = make_step([1] * len(lens), lens, 9, 3, 64, 16)
    kernel = load_kernel()
    assert kernel is not None
    cache = cache.clone()
    one = torch.full(qkv[0].shape, float("nan"))
    many = torch.full(qkv[0].shape, float("nan"))
    plan = KernelPlan.build(list(range(len(lens))), lens, meta.block_tables_cpu, 16)
    kernel.run(qkv[0], cache, plan, 0.125, one, threads=1)
    kernel.run(qkv[0], cache, plan, 0.125, many, threads=2)
    assert torch.equal(one, many)  # a sequence's sums never depend on the thread count


@needs_kernel
def test_mixed_step_kernel_writes_only_decode_rows(monkeypatch) -> None:
    """Prefill chunks (whole prompts, prefix hits) between decode rows: SDPA does the chunks,
    the kernel the decode rows at their places in q and out."""
    q_lens, s_lens = [1, 7, 1, 40, 1], [33, 7, 1, 100, 1000]
    meta, cache, qkv = make_step(q_lens, s_lens, 9, 3, 64, 16)
    backend = TorchAttentionBackend(CPU)
    calls = spy_on_kernel(backend, monkeypatch)
    got, got_cache = run(backend, meta, cache, qkv)
    assert calls == [3]
    want, want_cache = run(TorchAttentionBackend(CPU, cpu_kernel=False), meta, cache, qkv)
    assert torch.equal(got_cache, want_cache)
    decode = [0, 8, 49]  # q rows of the single-token sequences
    prefill = [i for i in range(got.shape[0]) if i not in decode]
    assert torch.equal(got[prefill], want[prefill])  # same SDPA calls
    assert (got[decode] - want[decode]).abs().max().item() <= 1e-5


@needs_kernel
def test_decode_only_step_still_plans_the_compiled_path() -> None:
    """engine/compile.py traces the torch path: decode_step keeps giving its tensors."""
    meta, _, _ = make_step([1, 1], [20, 3], 4, 2, 64, 16)
    backend = TorchAttentionBackend(CPU)
    backend.plan(meta)
    step = backend.decode_step(2)
    assert step is not None
    slots, index, bias = step
    assert torch.equal(slots.blocks * 16 + slots.offsets, meta.slot_mapping)
    assert index.numel() == 2 * 2 * 2 * 32  # K and V, 2 rows, 2 heads, 2 blocks of 16
    assert bias.shape == (4, 1, 32)


def test_no_compiler_falls_back_to_torch(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cpu_kernel, "find_compiler", lambda: None)
    load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.engine.attention.cpu_kernel"):
            backend = TorchAttentionBackend(CPU)
            TorchAttentionBackend(CPU)
    finally:
        load_kernel.cache_clear()
    assert backend._kernel is None
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # once a process
    assert "no C compiler" in caplog.records[0].getMessage()
    meta, cache, qkv = make_step([1] * 6, RAGGED, 9, 3, 64, 16)
    got, written = run(backend, meta, cache, qkv)
    want, _ = run(TorchAttentionBackend(CPU, cpu_kernel=False), meta, cache, qkv)
    assert torch.equal(got, want)
    assert (got.double() - reference(meta, written, qkv)).abs().max().item() <= 5e-6


def test_failed_build_falls_back(monkeypatch, caplog, tmp_path) -> None:
    monkeypatch.setattr(cpu_kernel, "find_compiler", lambda: "/bin/false")
    monkeypatch.setattr(cpu_kernel, "pdserve_home", lambda: tmp_path)
    load_kernel.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.engine.attention.cpu_kernel"):
            assert load_kernel() is None
    finally:
        load_kernel.cache_clear()
    assert "unavailable" in caplog.text
    assert list((tmp_path / "kernels").iterdir()) == []  # no temporary file left behind


@needs_kernel
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_bf16_cache_is_float32_attention_rounded_once(dim, monkeypatch) -> None:
    """bf16 q and cache: the kernel sums in float32 and rounds the output once, closer to
    exact than the torch path (which rounds scores and probabilities to bf16 too)."""
    meta, cache, qkv = make_step([1] * 6, RAGGED, 9, 3, dim, 16, dtype=torch.bfloat16)
    backend = TorchAttentionBackend(CPU)
    calls = spy_on_kernel(backend, monkeypatch)
    got, written = run(backend, meta, cache, qkv)
    assert calls == [6] and got.dtype == torch.bfloat16
    want, _ = run(TorchAttentionBackend(CPU, cpu_kernel=False), meta, cache, qkv)
    exact = reference(meta, written, qkv)  # of the bf16 values, in float64
    err = (got.double() - exact).abs()
    assert (err <= exact.abs() * 2**-8 + 1e-6).all()  # half a bf16 ulp, and float32 noise
    assert err.max() < (want.double() - exact).abs().max()


@needs_kernel
def test_fp16_cache_goes_through_torch_logged_once(caplog) -> None:
    meta, cache, qkv = make_step([1] * 6, RAGGED, 9, 3, 64, 16, dtype=torch.float16)
    backend = TorchAttentionBackend(CPU)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.attention.torch_backend"):
        got, _ = run(backend, meta, cache, qkv)
        run(backend, meta, cache, qkv)
    want, _ = run(TorchAttentionBackend(CPU, cpu_kernel=False), meta, cache, qkv)
    assert torch.equal(got, want)
    assert len(caplog.records) == 1 and "through torch" in caplog.records[0].getMessage()


@needs_kernel
def test_build_is_cached_and_atomic(tmp_path) -> None:
    compiler = find_compiler()
    assert compiler is not None
    paths: list = []
    threads = [
        threading.Thread(target=lambda: paths.append(build(compiler, tmp_path))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(paths) == 2 and paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temporaries left
    mtime = paths[0].stat().st_mtime_ns
    assert build(compiler, tmp_path) == paths[0]
    assert paths[0].stat().st_mtime_ns == mtime  # found, not rebuilt
