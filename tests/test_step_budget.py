"""The per-step token budget that fits a time budget: the fit with injected timings (exact
token counts), and a real engine on the tiny model calibrating once at start-up."""

from __future__ import annotations

import logging
import math

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.step_budget import StepBudget, calibrate_step_budget, fit_step_tokens
from tests.engine_util import greedy, prompts


class Clock:
    """A fake step cost in seconds for ``n`` tokens; remembers what it was asked."""

    def __init__(self, cost) -> None:
        self.cost = cost
        self.asked: list[int] = []

    def __call__(self, n: int) -> float:
        self.asked.append(n)
        return self.cost(n)


def fit(cost, **kw) -> StepBudget:
    args = dict(max_tokens=2048, budget_s=0.5, block_size=16, min_tokens=64) | kw
    return fit_step_tokens(Clock(cost), **args)


def test_a_step_within_budget_keeps_the_configured_max() -> None:
    # a small first probe, then straight to the configured max
    assert fit(lambda n: n / 8192) == StepBudget(2048, 0.5, ((256, 0.03125), (2048, 0.25)))


def test_proportional_cost_is_found_in_one_round() -> None:
    budget = fit(lambda n: n / 1024)  # 2048 tokens: 2 s
    assert budget == StepBudget(512, 0.5, ((256, 0.25), (512, 0.5)))
    shrunk = fit(lambda n: n / 256)  # from above: 256 tokens take 1 s
    assert shrunk == StepBudget(128, 0.5, ((256, 1.0), (128, 0.5)))
    assert budget.describe() == (
        "step budget: 512 tokens (500.0 ms measured for 512 tokens, budget 500 ms)"
    )


def test_a_fixed_cost_per_step_is_found_by_the_line_through_two_probes() -> None:
    # 62.5 ms a step + ~1 ms a token: 448 tokens take exactly the budget
    budget = fit(lambda n: 1 / 16 + n / 1024)
    assert budget.probes == ((256, 0.3125), (400, 0.453125), (448, 0.5))
    assert budget.tokens == 448


def test_a_superlinear_cost_is_bracketed_by_secants() -> None:
    # attention grows with the square of a prompt; the largest whole-block fit is 448
    budget = fit(lambda n: n / 1024 + n * n / 2**22)
    assert [n for n, _ in budget.probes] == [256, 480, 448]
    assert budget.tokens == 448


def test_results_are_whole_blocks_rounded_down() -> None:
    budget = fit(lambda n: n / 1000, block_size=32)  # 500 tokens fit: 480 is 15 blocks
    assert budget.probes == ((256, 0.256), (480, 0.48))
    assert budget.tokens == 480


def test_never_below_max_num_seqs(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.engine.step_budget"):
        budget = fit(lambda n: float(n))  # a second a token: nothing fits
    assert budget == StepBudget(64, 0.5, ((256, 256.0), (64, 64.0)))
    assert "over the 500 ms step budget, and no smaller step is allowed" in caplog.text


def test_the_floor_is_rounded_up_to_a_block_and_capped_by_the_max() -> None:
    assert fit(lambda n: float(n), min_tokens=20).tokens == 32
    slow = fit(lambda n: float(n), max_tokens=16, min_tokens=64)
    assert slow == StepBudget(16, 0.5, ((16, 16.0),))


def test_a_step_as_large_as_the_kv_cache_bounds_every_step() -> None:
    assert fit(lambda n: n / 1024, capacity=160).tokens == 2048  # 160 tokens: 156 ms
    budget = fit(lambda n: n / 64, capacity=160, min_tokens=16)
    assert budget == StepBudget(32, 0.5, ((160, 2.5), (32, 0.5)))


def test_when_rounds_run_out_the_last_estimate_stands() -> None:
    budget = fit(lambda n: n / 256, max_rounds=1)
    assert budget == StepBudget(128, 0.5, ((256, 1.0),))
    # but never a guess above a probe that fit
    assert fit(lambda n: n / 1024, max_rounds=1) == StepBudget(256, 0.5, ((256, 0.25),))


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive, got 0"):
        fit(lambda n: 1.0, budget_s=0)
    with pytest.raises(ConfigError, match="max_step_time_s must be a number of seconds"):
        SchedulerConfig(max_step_time_s=math.nan)


def test_a_run_slowed_by_contention_is_timed_again() -> None:
    # warm-up, a first run 2x over the budget, the retimed one, then the configured max
    runs = iter([0.001, 1.0, 0.02, 0.1])
    timer = Clock(lambda n: next(runs))
    config = SchedulerConfig(max_num_seqs=8)
    budget = calibrate_step_budget(None, BlockManager(600, 4), config, 2048, timer=timer)
    assert budget == StepBudget(2048, 0.5, ((256, 0.02), (2048, 0.1)))
    assert timer.asked == [4, 256, 256, 2048]
    # 20x over the budget: no second run of that probe
    timer = Clock(lambda n: n * 10 / 256)
    budget = calibrate_step_budget(None, BlockManager(600, 4), config, 2048, timer=timer)
    assert budget.tokens == 12 and timer.asked == [4, 256, 12]
    off = SchedulerConfig(max_step_time_s=-1)
    assert calibrate_step_budget(None, BlockManager(600, 4), off, 2048, timer=timer) is None


# ---- a real engine ----------------------------------------------------------------------------
def engine(path, max_step_time_s: float, max_num_batched_tokens: int = 2048) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            cache=CacheConfig(block_size=4, num_blocks=600),
            scheduler=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=max_num_batched_tokens,
                max_step_time_s=max_step_time_s,
            ),
        )
    )


def assert_all_blocks_free_in_order(e: LLMEngine) -> None:
    bm = e.block_manager
    assert bm.num_free_blocks == bm.num_blocks == 600
    assert list(bm.free) == list(range(600))  # block ids as a fresh engine hands them out
    assert bm.num_cached_blocks == 0  # the probe's dummy tokens never enter the prefix cache


def test_the_tiny_model_keeps_the_full_budget(tiny_dir) -> None:
    # 2,048 tokens take ~20 ms on an idle core, 30x under the default budget; a budget of
    # 10 s keeps this test exact on a saturated machine too (seen ~60x slower with torch's
    # threads fighting two busy processes for two cores)
    e = engine(tiny_dir, 10.0)
    assert e.scheduler.config.max_num_batched_tokens == 2048
    assert [n for n, _ in e.step_budget.probes] == [256, 2048]  # the max fits
    assert_all_blocks_free_in_order(e)
    off = engine(tiny_dir, 0)
    assert off.step_budget is None and off.scheduler.config.max_num_batched_tokens == 2048


def test_a_tiny_budget_shrinks_the_step_to_max_num_seqs(tiny_dir) -> None:
    e = engine(tiny_dir, 1e-9)
    assert e.step_budget.tokens == e.scheduler.config.max_num_batched_tokens == 8
    assert e.config.scheduler.max_num_batched_tokens == 2048  # the flag's value is kept
    assert_all_blocks_free_in_order(e)
    # chunks of 8: the same steps and tokens as an engine configured for 8
    vocab = e.model_config.vocab_size
    e.add_request("r", prompts(vocab, [25])[0], greedy(4))
    e.step()
    assert e.requests["r"].num_computed_tokens == 8
    while e.has_unfinished():
        e.step()
    fixed = engine(tiny_dir, 0, max_num_batched_tokens=8)
    batch = prompts(vocab, [25, 3, 17], seed=1)
    got = [o.new_token_ids for o in e.generate(batch, greedy(5))]
    assert got == [o.new_token_ids for o in fixed.generate(batch, greedy(5))]
