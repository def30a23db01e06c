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
    return make_engine(path, tensor_parallel_size=tp, threads=1, num_blocks=256, **kw)


@pytest.fixture(scope="module")
def reference(small_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens of one colocated process (TP 1), by prompt."""
    eng = make_engine(small_dir, num_blocks=256)
    base = prompts(eng.model_config.vocab_size, [5, 21, 40], seed=7)
    shared = base[2] + prompts(eng.model_config.vocab_size, [9], seed=8)[0]  # base[2]'s blocks
    batch = {"a": base[0], "b": base[1], "c": base[2], "shared": shared}
    outs = eng.generate(list(batch.values()), SamplingParams(**vars(GREEDY)))
    return {k: o.new_token_ids for k, o in zip(batch, outs, strict=True)} | {
        f"prompt:{k}": v for k, v in batch.items()
    }


@pytest.mark.parametrize("backend", ["zmq", "nixl"])
def test_kv_between_groups_of_any_sizes_is_exact(small_dir: Path, reference, backend) -> None:
    for p_tp, d_tp in SIZES:
        engines_p = [_engine(small_dir, p_tp, max_num_batched_tokens=16)]  # chunked prompts
        engines_d = [_engine(small_dir, d_tp)]
        cluster = Cluster(engines_p, engines_d, backend)
        try:
            for rid in ("a", "b", "c"):
                cluster.submit(rid, reference[f"prompt:{rid}"], GREEDY)
            cluster.pump()
            moved = cluster.workers["p0"].transfers.blocks
            # a prompt whose leading blocks the decode side holds: only the rest moves
            cluster.submit("shared", reference["prompt:shared"], GREEDY)
            cluster.pump()
            where = f"prefill TP {p_tp} -> decode TP {d_tp} over {backend}"
            for rid in ("a", "b", "c", "shared"):
                assert cluster.tokens(rid) == {0: reference[rid]}, where
            # 49 tokens in 4-token blocks: 13, the first 10 (c's 40 tokens) held by decode
            shared_blocks = cluster.workers["p0"].transfers.blocks - moved
            assert shared_blocks == 3, f"{where}: {shared_blocks} blocks moved, not the 3 missing"
            assert set(cluster.used_blocks().values()) == {0}, where
            for engine in engines_p + engines_d:  # staging blocks all given back
                staging = engine.runner.staging
                assert staging is None or staging.num_free == staging.num_blocks, where
                assert not engine.handoff.staged_in and not engine.handoff.staged_out, where
        finally:
            cluster.close()
            for engine in engines_p + engines_d:
                engine.close()


def test_n_choices_fork_in_a_decode_group(small_dir: Path) -> None:
    """n choices of one prompt: its KV lands once in a TP-2 decode group and is copied into
    each choice's last block on every rank (COPY_BLOCKS); seeded choices equal one process."""
    engines = [_engine(small_dir, 1), _engine(small_dir, 2)]
    cluster = Cluster(engines[:1], engines[1:], "zmq")
    try:
        spec = m.SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
        prompt = prompts(engines[0].model_config.vocab_size, [10], seed=4)[0]
        cluster.submit("r", prompt, spec, n=3)
        cluster.pump()
        got = cluster.tokens("r")
        alone = make_engine(small_dir, num_blocks=256)
        for c in range(3):
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=5 + c, ignore_eos=True)
            assert got[c] == alone.generate([prompt], params)[0].new_token_ids
        assert set(cluster.used_blocks().values()) == {0}
    finally:
        cluster.close()
        for engine in engines:
            engine.close()
