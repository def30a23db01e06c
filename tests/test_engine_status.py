"""What a worker reads of its engine (``EngineStatus``, engine/engine.py): exact block and queue
figures as a chunked prompt and a short one go from waiting to decoding, and a repeated
prompt's cache hit."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.protocol.blocks import blocks_for
from tests.engine_util import greedy, prompts, run_all


def engine(path: Path) -> LLMEngine:
    """Blocks of 4 tokens, 16 tokens a step, no step-time calibration (it could lower that)."""
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            cache=CacheConfig(block_size=4, num_blocks=64),
            scheduler=SchedulerConfig(max_num_batched_tokens=16, max_step_time_s=0),
        )
    )


def test_figures_follow_the_queues(tiny_dir: Path) -> None:
    e = engine(tiny_dir)
    long, short = prompts(e.model_config.vocab_size, [17, 5], seed=3)
    s = e.status
    assert (s.block_size, s.num_blocks, blocks_for(17, s.block_size)) == (4, 64, 5)
    assert blocks_for(16, s.block_size) == 4
    assert [layer.shape[0] for layer in s.kv_layers] == [64] * len(s.kv_layers)
    e.add_request("a", long, greedy(3))
    e.add_request("b", short, greedy(3))
    status = (s.num_waiting, s.num_running, s.num_used_blocks, s.num_free_blocks)
    assert (status, s.queued_prompt_tokens) == ((2, 0, 0, 64), 17 + 5)
    e.step()  # a's first 16 tokens fill the step; b waits
    status = (s.num_waiting, s.num_running, s.num_used_blocks, s.num_free_blocks)
    assert (status, s.queued_prompt_tokens) == ((1, 1, 4, 60), 1 + 5)  # a's last prompt token
    e.step()  # a's last prompt token and all of b: each samples token 0
    status = (s.num_waiting, s.num_running, s.num_used_blocks)
    assert (status, s.queued_prompt_tokens) == ((0, 2, 5 + 2), 0)  # decode steps are not counted


def test_prefix_hits_and_kv_events(tiny_dir: Path) -> None:
    e = engine(tiny_dir)
    publisher = e.status.kv_event_publisher("w0")
    [prompt] = prompts(e.model_config.vocab_size, [17], seed=4)
    run_all_of(e, "a", prompt)
    assert e.status.prefix_hit_tokens == 0
    [snapshot] = publisher.messages()  # the first period: everything cached, as a snapshot
    assert snapshot.snapshot and len(snapshot.stored) == 4  # a's full prompt blocks
    run_all_of(e, "b", prompt)
    assert e.status.prefix_hit_tokens == 16  # every full block but the one with the last token
    assert e.status.num_used_blocks == 0 and e.status.num_free_blocks == 64


def run_all_of(e: LLMEngine, request_id: str, prompt: list[int]) -> None:
    e.add_request(request_id, prompt, greedy(1))
    assert run_all(e)[request_id].finished
