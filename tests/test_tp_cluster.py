"""Prefill and decode pools of different tensor-parallel sizes: KV re-split between groups of A
and B ranks (engine/tp/staging.py) over zmq and NIXL, token for token what one process makes."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.engine import LLMEngine
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams
from tests.cluster_util import Cluster
from tests.engine_util import make_engine, prompts

GREEDY = m.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SIZES = [(2, 1), (1, 2), (2, 2)]  # (prefill TP, decode TP)


def _engine(path: Path, tp: int, **kw: object) -> LLMEngine:
    return make_engine(
        path, tensor_parallel_size=tp, threads=1, num_blocks=256, tp_timeout_s=120.0, **kw
    )


def _batch(vocab: int, seed: int) -> dict[str, list[int]]:
    """Three prompts, and a fourth sharing the third's 40 tokens (10 blocks of 4)."""
    base = prompts(vocab, [5, 21, 40], seed=seed)
    shared = base[2] + prompts(vocab, [9], seed=seed + 100)[0]
    return {"a": base[0], "b": base[1], "c": base[2], "shared": shared}


@pytest.fixture(scope="module")
def alone(small_dir: Path) -> LLMEngine:
    """One colocated process (TP 1): the tokens every split must give."""
    return make_engine(small_dir, num_blocks=256)


@pytest.fixture(scope="module")
def engines(small_dir: Path):
    """TP 1 and TP 2 engines of each role, shared by every pair of sizes and transport (a
    group's start is most of what these tests cost)."""
    made = {("p", tp): _engine(small_dir, tp, max_num_batched_tokens=16) for tp in (1, 2)}
    made |= {("d", tp): _engine(small_dir, tp) for tp in (1, 2)}  # prefill above: chunked
    yield made
    for engine in made.values():
        engine.close()


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_kv_between_groups_of_any_sizes_is_exact(alone, engines, backend) -> None:
    """Each pair of sizes, prompts of its own (a decode cache keeps the blocks of the pairs
    before it)."""
    vocab = alone.model_config.vocab_size
    for i, (p_tp, d_tp) in enumerate(SIZES):
        batch = _batch(vocab, seed=7 + 10 * i + (100 if backend == "nixl" else 0))
        outs = alone.generate(list(batch.values()), SamplingParams(**vars(GREEDY)))
        want = {k: o.new_token_ids for k, o in zip(batch, outs, strict=True)}
        cluster = Cluster([engines["p", p_tp]], [engines["d", d_tp]], backend)
        try:
            where = f"prefill TP {p_tp} -> decode TP {d_tp} over {backend}"
            _check_pair(cluster, batch, want, where)
        finally:
            cluster.close()


def _check_pair(
    cluster: Cluster, batch: dict[str, list[int]], want: dict[str, list[int]], where: str
) -> None:
    for rid in ("a", "b", "c"):
        cluster.submit(rid, batch[rid], GREEDY)
    cluster.pump()
    moved = cluster.workers["p0"].transfers.blocks
    # a prompt whose leading blocks the decode side holds: only the rest moves
    cluster.submit("shared", batch["shared"], GREEDY)
    cluster.pump()
    for rid in batch:
        assert cluster.tokens(rid) == {0: want[rid]}, where
    # 49 tokens in 4-token blocks: 13, the first 10 (c's 40 tokens) held by decode
    shared_blocks = cluster.workers["p0"].transfers.blocks - moved
    assert shared_blocks == 3, f"{where}: {shared_blocks} blocks moved, not the 3 missing"
    assert set(cluster.used_blocks().values()) == {0}, where
    for worker in cluster.workers.values():  # staging blocks all given back
        staging, handoff = worker.engine.runner.staging, worker.engine.handoff
        assert staging is None or staging.num_free == staging.num_blocks, where
        assert not handoff.staged_in and not handoff.staged_out, where


def test_n_choices_fork_in_a_decode_group(alone, engines) -> None:
    """n choices of one prompt: its KV lands once in a TP-2 decode group and is copied into
    each choice's last block on every rank (COPY_BLOCKS); seeded choices equal one process."""
    cluster = Cluster([engines["p", 1]], [engines["d", 2]], "zmq")
    try:
        spec = m.SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
        prompt = prompts(alone.model_config.vocab_size, [10], seed=4)[0]
        cluster.submit("r", prompt, spec, n=3)
        cluster.pump()
        got = cluster.tokens("r")
        for c in range(3):
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=5 + c, ignore_eos=True)
            assert got[c] == alone.generate([prompt], params)[0].new_token_ids
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


def _served_as_alone(cluster: Cluster, alone: LLMEngine, seed: int) -> None:
    """A batch of prompts through ``cluster`` gives one process's greedy tokens."""
    batch = _batch(alone.model_config.vocab_size, seed=seed)
    outs = alone.generate(list(batch.values()), SamplingParams(**vars(GREEDY)))
    for rid, prompt in batch.items():
        cluster.submit(rid, prompt, GREEDY)
    cluster.pump()
    for rid, out in zip(batch, outs, strict=True):
        assert cluster.tokens(rid) == {0: out.new_token_ids}


def test_a_colocated_group_prefills_and_decodes_itself(alone, engines) -> None:
    """A TP-2 worker that runs both phases (colocated, the local-prefill path): its prompts
    never leave it, the tokens equal one process's."""
    cluster = Cluster([], [engines["d", 2]], colocated=True)
    try:
        _served_as_alone(cluster, alone, seed=300)
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()


def test_kv_streamed_in_parts_from_a_group(alone, engines) -> None:
    """``--kv-stream-chunks`` from a TP-2 prefill group: each chunk's finished blocks are
    gathered on rank 0 and offered while the prompt still computes (NIXL reads them)."""
    cluster = Cluster([engines["p", 2]], [engines["d", 2]], "nixl", stream_chunks=True)
    sender, lasts = cluster.workers["p0"].sender, []
    send_part = sender.send_part

    def spy(spec, kv_layers, last):  # every part offered: whether it was a transfer's last
        lasts.append(last)
        send_part(spec, kv_layers, last)

    sender.send_part = spy
    try:
        _served_as_alone(cluster, alone, seed=400)
        assert set(cluster.used_blocks().values()) == {0}
        assert lasts.count(False) >= 2  # parts went before their prompts were done
        for engine in (engines["p", 2], engines["d", 2]):
            staging = engine.runner.staging
            assert staging is not None and staging.num_free == staging.num_blocks
    finally:
        cluster.close()
