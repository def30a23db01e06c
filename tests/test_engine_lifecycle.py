"""Engine lifecycle: aborts in every state free every block; bad input is a clear error."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from pdserve.engine.config import ConfigError
from pdserve.engine.loader import ModelLoadError
from pdserve.protocol.messages import FinishReason
from pdserve.protocol.sampling import SamplingParams
from tests.engine_util import greedy, hf_greedy, make_engine, prompts, run_all


def test_abort_in_every_state_frees_blocks(tiny_dir) -> None:
    engine = make_engine(tiny_dir, max_num_batched_tokens=16, max_num_seqs=2)
    vocab = engine.model_config.vocab_size
    long_prompt, short, queued = prompts(vocab, [40, 5, 7], seed=10)
    engine.add_request("short", short, greedy(20))
    engine.add_request("long", long_prompt, greedy(20))  # chunked by the 16-token budget
    engine.add_request("queued", queued, greedy(20))  # max_num_seqs=2 keeps it waiting
    engine.step()
    engine.step()
    assert engine.requests["long"].num_computed_tokens < 40  # mid-prefill
    assert engine.requests["short"].num_output_tokens > 0  # decoding
    for rid in ("long", "short", "queued"):
        assert engine.abort(rid)
    assert not engine.abort("long")
    outs = engine.step()
    assert {o.request_id: o.finish_reason for o in outs} == {
        "long": "abort",
        "short": "abort",
        "queued": "abort",
    }
    assert all(o.finish_reason is FinishReason.ABORT for o in outs)  # the Enum, not a str
    assert all(o.finished for o in outs)
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished()


def test_random_finishes_and_aborts_return_every_block(tiny_dir) -> None:
    engine = make_engine(tiny_dir, num_blocks=40, max_num_batched_tokens=24)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    shared = prompts(vocab, [12], seed=11)[0]
    next_id = 0
    for _ in range(60):
        if rng.random() < 0.4:
            p = (shared if rng.random() < 0.5 else []) + prompts(
                vocab, [rng.randint(1, 20)], seed=next_id
            )[0]
            engine.add_request(f"r{next_id}", p, greedy(rng.randint(1, 12)))
            next_id += 1
        if engine.requests and rng.random() < 0.2:
            engine.abort(rng.choice(sorted(engine.requests)))
        engine.step()
    run_all(engine)
    bm = engine.block_manager
    assert bm.num_used_blocks == 0
    assert not any(bm.ref_counts)
    assert bm.num_free_blocks == bm.num_blocks


def test_duplicate_and_invalid_requests(tiny_dir) -> None:
    engine = make_engine(tiny_dir, num_blocks=8)
    engine.add_request("a", [1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("a", [1, 2, 3], greedy(2))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [], greedy(2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("c", [1, 10**9], greedy(2))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("d", [1] * 10, greedy(10**6))
    with pytest.raises(ValueError, match="KV cache"):  # 8 blocks x 4 tokens = 32
        engine.add_request("e", [1] * 32, greedy(1))  # the prompt and token 0's slot: 33
    engine.add_request("f", [1] * 30, greedy(10))  # max_tokens books no KV: it grows
    run_all(engine)
    assert engine.block_manager.num_used_blocks == 0


def test_bfloat16_and_float16_load_and_run(tiny_dir) -> None:
    import torch

    for dtype, torch_dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        engine = make_engine(tiny_dir, dtype=dtype)
        assert engine.runner.dtype == torch_dtype
        assert engine.runner.kv_cache.layers[0].dtype == torch_dtype
        out = engine.generate(prompts(engine.model_config.vocab_size, [7]), greedy(4))[0]
        assert len(out.new_token_ids) == 4


def test_sharded_checkpoint_matches_single_file(tmp_path) -> None:
    from pdserve.models.make_model import make_model

    single = make_model(tmp_path / "one", preset="tiny", seed=3)
    sharded = make_model(tmp_path / "two", preset="tiny", seed=3, num_shards=2)
    assert (sharded / "model.safetensors.index.json").is_file()
    batch = prompts(512, [5, 9], seed=12)
    a = make_engine(single).generate(batch, greedy(6))
    b = make_engine(sharded).generate(batch, greedy(6))
    assert [o.new_token_ids for o in a] == [o.new_token_ids for o in b]
    assert a[0].new_token_ids == hf_greedy(sharded, batch[0], 6)


def test_loader_errors_name_what_is_missing(tiny_dir, tmp_path) -> None:
    broken = tmp_path / "m"
    shutil.copytree(tiny_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())

    (broken / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        make_engine(broken)

    (broken / "config.json").write_text(json.dumps(cfg))
    for f in broken.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        make_engine(broken)

    (broken / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        make_engine(broken)

    with pytest.raises(ConfigError, match="does not exist"):
        make_engine(tmp_path / "nowhere")


def test_missing_tensor_is_named(tiny_dir, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "m"
    shutil.copytree(tiny_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        make_engine(broken)


def test_sampling_params_defaults_are_sane() -> None:
    p = SamplingParams()
    assert not p.greedy and not p.has_penalties and p.logprobs is None
