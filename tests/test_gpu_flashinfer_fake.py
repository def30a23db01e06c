"""FlashInferBackend's own code on CPU, over a stand-in flashinfer (tests/flashinfer_fake.py)
that computes attention from the page lists alone: outputs equal the torch backend's, each
step plans one wrapper once (not per layer), greedy tokens through the engine are unchanged,
and a CUDA-graph decode step padded to its bucket equals the eager step."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, TorchAttentionBackend
from pdserve.engine.attention import flashinfer_backend as fb
from pdserve.engine.cuda_graphs import CudaGraphRunner, decode_slots, pad_slot
from pdserve.protocol.sampling import SamplingParams
from tests.engine_util import make_engine, prompts
from tests.flashinfer_fake import fake_flashinfer

CPU = torch.device("cpu")
BS = 4


@pytest.fixture
def fi(monkeypatch):
    """The fake module in place, and kernels claimed for float32 and the tiny head size."""
    mod = fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(fb, "KERNEL_DTYPES", (torch.float32, torch.bfloat16))
    monkeypatch.setattr(fb, "KERNEL_HEAD_DIMS", (8, 16, 64, 128))
    return mod


def metadata(query_lens, seq_lens, tables) -> AttentionMetadata:
    starts, slots = [0], []
    for q, s, table in zip(query_lens, seq_lens, tables, strict=True):
        starts.append(starts[-1] + q)
        slots += [table[p // BS] * BS + p % BS for p in range(s - q, s)]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(tables), 1, dtype=torch.int32),  # unused by both
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=tables,
        block_size=BS,
    )


def run_layers(backend, meta, heads=8, kv_heads=2, dim=16, layers=2, seed=0):
    """plan once, forward ``layers`` times (as the model does); outputs and caches."""
    g = torch.Generator().manual_seed(seed)
    t = meta.num_tokens
    caches = [torch.randn(12, 2, BS, kv_heads, dim, generator=g) for _ in range(layers)]
    qkv = [
        (torch.randn(t, heads, dim, generator=g), torch.randn(t, kv_heads, dim, generator=g),
         torch.randn(t, kv_heads, dim, generator=g))
        for _ in range(layers)
    ]  # fmt: skip
    backend.plan(meta)
    outs = [
        backend.forward(q, k, v, c, dim**-0.5) for (q, k, v), c in zip(qkv, caches, strict=True)
    ]
    return outs, caches


MIXED = ([1, 3, 4, 1], [5, 9, 4, 8], [[7, 2, 11], [0, 5, 9], [3], [4, 6]])
DECODE = ([1, 1, 1], [5, 9, 13], [[7, 2], [0, 5, 9], [3, 1, 4, 8]])


@pytest.mark.parametrize(("case", "wrapper"), [(MIXED, "prefill"), (DECODE, "decode")])
def test_forward_equals_torch_and_plans_once(fi, case, wrapper) -> None:
    meta = metadata(*case)
    expected, expected_caches = run_layers(TorchAttentionBackend(CPU), meta)
    backend = fb.FlashInferBackend(CPU, workspace_bytes=1024)
    got, caches = run_layers(backend, meta)
    for a, b in zip(got + caches, expected + expected_caches, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    used = [w for w in fi.made if w.plans]
    assert len(used) == 1 and type(used[0]).__name__.startswith(f"Batch{wrapper.title()}")
    assert (len(used[0].plans), used[0].runs) == (1, 2)  # one plan for both layers
    plan = used[0].plans[0]
    assert (plan["num_qo_heads"], plan["num_kv_heads"], plan["head_dim"]) == (8, 2, 16)
    assert plan["page_size"] == BS and plan["sm_scale"] == 16**-0.5
    assert plan["causal"] is (wrapper == "prefill")
    if wrapper == "decode":
        assert used[0].kw == {"use_tensor_cores": True}  # GQA group 4


def test_engine_tokens_unchanged(fi, tiny_dir) -> None:
    ps = prompts(512, [3, 9, 17, 30])
    hit = [*ps[3][:20], 1, 2, 3]  # its first 20 tokens' blocks are cached by then
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def tokens(engine):
        first = engine.generate(ps, params)
        second = engine.generate([hit], params)[0]
        return [o.new_token_ids for o in [*first, second]], second.num_cached_tokens

    expected, _ = tokens(make_engine(tiny_dir))
    engine = make_engine(tiny_dir, max_num_batched_tokens=16)  # chunked prefill as well
    engine.runner.backend = fb.FlashInferBackend(CPU, workspace_bytes=1024)
    steps = []
    execute = engine.runner.execute
    engine.runner.execute = lambda inputs: steps.append(1) or execute(inputs)
    got, cached = tokens(engine)
    assert got == expected and cached == 20
    plans = sum(len(w.plans) for w in fi.made)
    runs = sum(w.runs for w in fi.made)
    assert plans == len(steps) and runs == 2 * len(steps)  # tiny has 2 layers


def test_unsupported_kernels_fall_back_to_torch(fi, tiny_dir, monkeypatch, caplog) -> None:
    monkeypatch.setattr(fb, "KERNEL_HEAD_DIMS", (64, 128))
    ps = prompts(512, [5, 12])
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = [o.new_token_ids for o in make_engine(tiny_dir).generate(ps, params)]
    engine = make_engine(tiny_dir)
    engine.runner.backend = fb.FlashInferBackend(CPU, workspace_bytes=1024)
    assert [o.new_token_ids for o in engine.generate(ps, params)] == expected
    assert not any(w.plans for w in fi.made)
    warnings = [r.message for r in caplog.records if "go to the torch backend" in r.message]
    assert len(warnings) == 1


def test_padded_graph_step_equals_eager_step(fi, tiny_dir) -> None:
    engine = make_engine(tiny_dir, block_size=BS, num_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts(engine.model_config.vocab_size, [5, 9, 3])):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # every prompt prefilled, token 0 sampled
    batch = engine.scheduler.schedule()
    assert batch.num_new_tokens == [1, 1, 1]
    runner = engine.runner
    inputs = runner.prepare(batch.seqs, batch.num_new_tokens)
    meta = inputs.metadata
    eager_cache = [t.clone() for t in runner.kv_cache.layers]
    padded_cache = [t.clone() for t in runner.kv_cache.layers]
    backend = fb.FlashInferBackend(CPU, workspace_bytes=1024)
    with torch.inference_mode():
        runner.backend.plan(meta)
        eager = runner.model(inputs.input_ids, inputs.positions, eager_cache, runner.backend)
        graphs = CudaGraphRunner(
            runner.model, padded_cache, backend, engine.model_config, [1, 2, 4], 16, capture=False
        )
        graphs.setup()
        assert graphs.can_run(meta)
        assert not graphs.can_run(dataclasses.replace(meta, query_lens_cpu=[2, 1, 1]))
        padded = graphs.run(inputs)

    assert padded.shape == eager.shape == (3, engine.model_config.hidden_size)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    wrappers = {w.fixed_batch: w for w in fi.made if w.fixed_batch}
    assert sorted(wrappers) == [1, 2, 4]
    assert [len(wrappers[b].plans) for b in (1, 2, 4)] == [0, 0, 1]  # only bucket 4 ran
    assert wrappers[4].runs == 2  # both layers, one plan
    state = graphs._states[4]
    assert state.valid.tolist() == [True, True, True, False]
    slot = pad_slot(decode_slots(meta.seq_lens_cpu, meta.block_tables_cpu, BS))
    assert state.slot_mapping.tolist() == [*meta.slot_mapping.tolist(), slot]
    assert wrappers[4].idx.last_page_len[3] == slot % BS + 1
    for before, a, b in zip(runner.kv_cache.layers, eager_cache, padded_cache, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(b[slot // BS, :, slot % BS], before[slot // BS, :, slot % BS])
        assert not torch.equal(a, before)  # the step did write K/V
