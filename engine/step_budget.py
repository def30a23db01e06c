"""How many tokens one step may take: the most that run within a time budget on this machine.

A step's cost grows with its tokens, and every decode stream batched with a prefill chunk
waits for the whole step: a 2,048-token chunk of SmolLM2-135M takes 5 to 7 s on one CPU
core. At start-up the engine times prefills of dummy tokens through its own ``ModelRunner``
and caps ``max_num_batched_tokens`` at the largest count that fits ``max_step_time_s``::

    probe N = 256 ── next N on the line through the two probes nearest the budget (one probe:
                     N · budget / t) ── rounded down to whole blocks ── probe again
                     (a few rounds; the configured max if a probe of it fits)

Once per process, never per step: chunk boundaries then depend on the configuration and this
one figure, not on any step's timing noise, so greedy outputs stay token-exact between
processes that calibrate alike (the tiny test model keeps the configured max, ~30x under
the default budget).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Sequence
from pdserve.protocol.blocks import blocks_for, full_blocks
from pdserve.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_ROUNDS = 4  # probes in all
FIRST_PROBE = 256  # tokens: a fraction of a second even for a slow model
RETIME_BELOW = 4.0  # a probe over the budget by less than this factor is timed twice


@dataclass(frozen=True)
class StepBudget:
    tokens: int  # the effective max_num_batched_tokens
    budget_s: float
    probes: tuple[tuple[int, float], ...]  # (tokens, seconds) as measured, in order

    def describe(self) -> str:
        """``step budget: N tokens (X ms measured for M tokens, budget Y ms)``."""
        n, t = next((p for p in self.probes if p[0] == self.tokens), self.probes[-1])
        return (
            f"step budget: {self.tokens} tokens ({t * 1e3:.1f} ms measured for {n} tokens, "
            f"budget {self.budget_s * 1e3:.0f} ms)"
        )


def fit_step_tokens(
    measure: Callable[[int], float],
    max_tokens: int,
    budget_s: float,
    block_size: int,
    min_tokens: int,
    capacity: int | None = None,
    max_rounds: int = MAX_ROUNDS,
    first_probe: int = FIRST_PROBE,
) -> StepBudget:
    """The largest step (in tokens) that ``measure`` says runs within ``budget_s`` seconds.

    Results are whole blocks in ``[min(max_tokens, min_tokens rounded up to a block),
    max_tokens]``. ``capacity``: the most tokens one step can hold here (KV slots); when a
    probe of that many fits, no step can be slower, so ``max_tokens`` stays. Probing starts
    small (``first_probe``), so a slow model spends about the budget, not seconds, on it."""
    if budget_s <= 0:
        raise ValueError(f"the step time budget must be positive, got {budget_s}")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    low = min(max_tokens, blocks_for(max(min_tokens, block_size), block_size) * block_size)
    top = min(max_tokens, capacity) if capacity else max_tokens
    probes: list[tuple[int, float]] = []
    fits: list[tuple[int, float]] = []  # probes within budget, largest last
    over: tuple[int, float] | None = None  # the smallest probe over it
    n = min(top, max(low, first_probe))
    for _ in range(max_rounds):
        t = measure(n)
        probes.append((n, t))
        if t <= budget_s:
            if n >= top:
                return StepBudget(max_tokens, budget_s, tuple(probes))
            fits.append((n, t))
        else:
            over = (n, t)
        guess = _next_guess(fits[-2:], over, budget_s)
        n = min(top, max(low, full_blocks(max(guess, 0), block_size) * block_size))
        if (over is not None and n >= over[0]) or (fits and n <= fits[-1][0]):
            break  # nothing left to learn: at the floor, or no better than what fits
    if fits:
        return StepBudget(fits[-1][0], budget_s, tuple(probes))
    if over is not None and n >= over[0]:
        logger.warning(
            "a step of %d tokens takes %.0f ms here, over the %.0f ms step budget, and no "
            "smaller step is allowed: taking %d tokens a step",
            probes[-1][0],
            probes[-1][1] * 1e3,
            budget_s * 1e3,
            n,
        )
    return StepBudget(n, budget_s, tuple(probes))  # the last guess, rounds used up


def _next_guess(
    fits: list[tuple[int, float]], over: tuple[int, float] | None, budget_s: float
) -> int:
    """Where the budget is crossed: on the line through the two probes nearest it (one on
    each side, or the two largest that fit), else in proportion to the one probe there is."""
    pair = [fits[-1], over] if fits and over else fits if len(fits) == 2 else None
    if pair is None:  # cost proportional to tokens
        n, t = over or fits[-1]
        return int(n * budget_s / t)
    (n0, t0), (n1, t1) = pair
    if t1 <= t0:  # timing noise: no slope to follow
        return n0 if over else int(n1 * budget_s / t1)
    return int(n0 + (budget_s - t0) * (n1 - n0) / (t1 - t0))


def calibrate_step_budget(
    runner: ModelRunner,
    blocks: BlockManager,
    config: SchedulerConfig,
    max_model_len: int,
    timer: Callable[[int], float] | None = None,
) -> StepBudget | None:
    """Time prefills through ``runner`` and fit the step budget; None when it is off.

    Each probe allocates its blocks and frees them in reverse, so afterwards every block is
    free and the free list is in its original order (block ids stay as a fresh engine's).
    ``timer(num_tokens) -> seconds`` stands in for the probes in tests."""
    budget_s = config.max_step_time_s
    if budget_s <= 0:
        return None
    capacity = blocks.num_blocks * blocks.block_size
    run = timer or functools.partial(time_prefill, runner, blocks, max_model_len=max_model_len)

    def measure(num_tokens: int) -> float:
        t = run(num_tokens)
        # Another process can only ever slow a run down: a probe near the budget is timed
        # again and the faster run counts, so a moment's contention does not shrink the
        # budget (far over it, shrinking is needed anyway and a second run costs the most).
        if budget_s < t < RETIME_BELOW * budget_s:
            t = min(t, run(num_tokens))
        return t

    start = time.perf_counter()
    run(min(blocks.block_size, capacity))  # warm-up (first-call costs), untimed
    # The floor is max_num_seqs: the scheduler serves running sequences in order until the
    # budget runs out, so a smaller budget would starve the newest of their decode tokens.
    budget = fit_step_tokens(
        measure,
        config.max_num_batched_tokens,
        budget_s,
        blocks.block_size,
        min_tokens=config.max_num_seqs,
        capacity=capacity,
    )
    logger.info("%s; calibrated in %.2f s", budget.describe(), time.perf_counter() - start)
    return budget


def time_prefill(
    runner: ModelRunner, blocks: BlockManager, num_tokens: int, max_model_len: int
) -> float:
    """Seconds one step takes to prefill ``num_tokens`` dummy tokens (in sequences of at most
    ``max_model_len``), inputs prepared and the device synchronised."""
    seqs: list[Sequence] = []
    for i, start in enumerate(range(0, num_tokens, max_model_len)):
        n = min(max_model_len, num_tokens - start)
        seqs.append(Sequence(f"step-budget-probe-{i}", [0] * n, SamplingParams(max_tokens=1)))
    return time_probe_step(runner, blocks, seqs, [s.num_tokens for s in seqs])


def time_probe_step(
    runner: ModelRunner, blocks: BlockManager, seqs: list[Sequence], chunks: list[int]
) -> float:
    """Seconds one step of probe ``seqs`` takes, each computing its last ``chunks[i]`` tokens
    (the rest counted as computed): blocks taken for them and freed after, inputs prepared
    and the device synchronised."""
    taken: list[Sequence] = []
    try:
        for seq, n in zip(seqs, chunks, strict=True):
            if not blocks.allocate(seq, seq.num_tokens):
                raise RuntimeError(f"no KV blocks for a step probe of {sum(chunks)} tokens")
            seq.num_computed_tokens = seq.num_tokens - n
            taken.append(seq)
        start = time.perf_counter()
        inputs = runner.prepare(seqs, chunks)
        runner.execute(inputs)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        return time.perf_counter() - start
    finally:
        for seq in reversed(taken):
            blocks.free_seq(seq)
