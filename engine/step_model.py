"""How long an engine step takes here, and so how many prompt tokens a step carrying decodes may
add and stay within the TPOT target (stall-free chunked prefill, as Sarathi-Serve sizes
chunks)::

    seconds(P prompt tokens, D decode sequences) = fixed + per_prefill_token·P + per_decode_seq·D
                                                 + batched·[P + D > SMALL_STEP_ROWS]

``batched`` is what a step of more than a row or two pays once: a quantized model's layers
dequantize every weight into tiles then (engine/quant/cpu_qlinear.c: ~0.1-0.2 s a step for
SmolLM2 on one core), where one or two rows dequantize in registers; for float weights it fits
near 0.

    start-up   probes of steps like the ones the target caps (decodes alone, decodes with a
               chunk of prompt: ``PROBES``) and of long prefills (step_budget's own when it
               ran), weighted least squares ── the prior
    each step  the engine observes (P, D, seconds); every REFIT_EVERY steps the terms are
               refit over the last WINDOW steps together with the prior's probes, each probe
               weighing PROBE_WEIGHT steps and each observed step carrying both decodes and
               prompt tokens MIXED_WEIGHT (they are what the target is for): a run of steps
               alike cannot invent the terms it does not vary, and a machine slower than at
               start-up (another process on the core) moves every term within a window

An observed step over OUTLIER times its prediction counts as that many times it (a pause is not
a cost; a lasting slowdown still moves the fit, a factor OUTLIER per refit). Terms are floored
at 0 (per prompt token at MIN_PER_TOKEN_S, so the room for prompt tokens stays finite).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Sequence
from pdserve.engine.step_budget import time_prefill, time_probe_step
from pdserve.protocol.blocks import blocks_for
from pdserve.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)

WINDOW = 256  # observed steps a refit looks at
REFIT_EVERY = 16
PROBE_WEIGHT = 4.0  # a start-up probe counts as this many observed steps
MIXED_WEIGHT = 4.0  # an observed step of decodes and prompt tokens counts as this many
OUTLIER = 3.0
MIN_PER_TOKEN_S = 1e-7
PREFILL_PROBES = (64, 256)  # tokens, when step_budget measured none
CONTEXT = 64  # tokens of KV each decode probe's sequence reads
# (prompt tokens, decode sequences) of the probes (as many sequences as fit)
PROBES = ((0, 1), (0, 2), (0, 8), (0, 16), (16, 1), (32, 4), (64, 8))
SMALL_STEP_ROWS = 2  # rows a quantized layer dequantizes in registers (int8: 4; 2 is safe)

Point = tuple[int, int, float]  # (prompt tokens, decode sequences, seconds)


@dataclass(frozen=True)
class StepCosts:
    """The model's four terms, in seconds."""

    fixed_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    batched_s: float = 0.0

    def seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        """Predicted seconds of a step of ``prefill_tokens`` and ``decode_seqs``."""
        row = _row(prefill_tokens, decode_seqs)
        return sum(c * x for c, x in zip(self.terms(), row, strict=True))

    def prefill_room(self, decode_seqs: int, target_s: float) -> int:
        """The most prompt tokens a step with ``decode_seqs`` may add within ``target_s``."""
        spare = target_s - self.fixed_s - self.per_decode_seq_s * decode_seqs
        small = max(0, SMALL_STEP_ROWS - decode_seqs)  # tokens before the batched term
        large = int((spare - self.batched_s) / self.per_prefill_token_s)
        if large > small:
            return large
        return max(0, min(small, int(spare / self.per_prefill_token_s))) if spare >= 0 else 0

    def terms(self) -> list[float]:
        """One value a ``protocol.control.STEP_MODEL_TERMS``, in its order."""
        return [self.fixed_s, self.per_prefill_token_s, self.per_decode_seq_s, self.batched_s]

    def describe(self) -> str:
        return (
            f"{self.fixed_s * 1e3:.2f} ms + {self.per_prefill_token_s * 1e6:.1f} us a prompt "
            f"token + {self.per_decode_seq_s * 1e3:.2f} ms a decode sequence + "
            f"{self.batched_s * 1e3:.2f} ms past {SMALL_STEP_ROWS} rows"
        )


def _row(prefill_tokens: int, decode_seqs: int) -> tuple[float, float, float, float]:
    batched = prefill_tokens + decode_seqs > SMALL_STEP_ROWS
    return (1.0, float(prefill_tokens), float(decode_seqs), 1.0 if batched else 0.0)


def fit(points: Iterable[tuple[Point, float]]) -> StepCosts:
    """Weighted least squares of ``seconds`` on the four terms over ``((P, D, seconds), weight)``.

    A term the points cannot tell apart from the others (a singular system: the last first)
    or that fits below zero explains nothing: it is dropped (0) and the rest refit. The
    prompt-token term is floored at ``MIN_PER_TOKEN_S`` instead."""
    rows = [(_row(p, d), t, w) for (p, d, t), w in points]
    active = [0, 1, 2, 3]
    while active:
        solved = _solve_normal(rows, active)
        if solved is None:
            active.pop()
            continue
        negative = [j for j, c in zip(active, solved, strict=True) if c < 0 and j != 1]
        if negative:
            active.remove(negative[-1])
            continue
        coef = [0.0] * 4
        for j, c in zip(active, solved, strict=True):
            coef[j] = c
        return StepCosts(coef[0], max(coef[1], MIN_PER_TOKEN_S), coef[2], coef[3])
    return StepCosts(0.0, MIN_PER_TOKEN_S, 0.0)


def _solve_normal(
    rows: Iterable[tuple[tuple[float, ...], float, float]], active: list[int]
) -> list[float] | None:
    """The normal equations of ``active`` terms, solved by Gaussian elimination (None when
    singular)."""
    k = len(active)
    a = [[0.0] * (k + 1) for _ in range(k)]
    for x, t, w in rows:
        for i, ji in enumerate(active):
            for j, jj in enumerate(active):
                a[i][j] += w * x[ji] * x[jj]
            a[i][k] += w * x[ji] * t
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        scale = max(abs(a[r][col]) for r in range(k)) or 1.0
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * u for v, u in zip(a[r], a[col], strict=True)]
    return [a[i][k] / a[i][i] for i in range(k)]


class StepModel:
    """The start-up fit, refit from observed steps (one writer: the engine's thread)."""

    def __init__(self, probes: list[Point]) -> None:
        if not probes:
            raise ValueError("the step-time model needs at least one start-up probe")
        self.probes = list(probes)
        self.costs = self.prior = fit((p, PROBE_WEIGHT) for p in self.probes)
        self._window: deque[Point] = deque(maxlen=WINDOW)
        self._since_refit = 0

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """One step that ran; refits every ``REFIT_EVERY``."""
        limit = OUTLIER * self.costs.seconds(prefill_tokens, decode_seqs)
        self._window.append((prefill_tokens, decode_seqs, min(max(seconds, 0.0), limit)))
        self._since_refit += 1
        if self._since_refit >= REFIT_EVERY:
            self._since_refit = 0
            points = [(p, PROBE_WEIGHT) for p in self.probes]
            seen = [(p, MIXED_WEIGHT if p[0] and p[1] else 1.0) for p in self._window]
            self.costs = fit([*points, *seen])


def calibrate_step_model(
    runner: ModelRunner,
    blocks: BlockManager,
    max_model_len: int,
    max_num_seqs: int,
    prefill_probes: Iterable[tuple[int, float]] = (),
    timer: Callable[[int, int], float] | None = None,
) -> StepModel:
    """Time ``PROBES`` (and long prefills, unless ``prefill_probes`` has two) through
    ``runner``.

    ``timer(prompt_tokens, decode_seqs) -> seconds`` stands in for the probes in tests. Every
    block is free again afterwards, in its original order (as step_budget leaves them)."""
    capacity = blocks.num_blocks * blocks.block_size
    context = max(1, min(CONTEXT, max_model_len, capacity // 32))
    per_seq_blocks = -(-context // blocks.block_size)
    run = timer or (lambda p, d: time_step(runner, blocks, p, d, context, max_model_len))
    start = time.perf_counter()
    run(0, 1)  # warm-up (first-call costs), untimed
    points: list[Point] = [(n, 0, t) for n, t in prefill_probes]
    if len({p for p, _, _ in points}) < 2:
        sizes = sorted({min(n, capacity) for n in PREFILL_PROBES})
        points = [(n, 0, run(n, 0)) for n in sizes]
    shapes = set()
    for p, d in PROBES:  # as many sequences as the blocks hold beside the prompt
        p = min(p, capacity // 2)
        room = blocks.num_blocks - blocks_for(p, blocks.block_size)
        if room >= per_seq_blocks:
            shapes.add((p, min(d, max_num_seqs, room // per_seq_blocks)))
    points += [(p, d, run(p, d)) for p, d in sorted(shapes)]
    model = StepModel(points)
    logger.info(
        "step-time model: %s (%d probes in %.2f s)",
        model.costs.describe(),
        len(points),
        time.perf_counter() - start,
    )
    return model


def time_step(
    runner: ModelRunner,
    blocks: BlockManager,
    prompt_tokens: int,
    decode_seqs: int,
    context: int,
    max_model_len: int,
) -> float:
    """Seconds one step takes: ``decode_seqs`` decodes, each over ``context`` tokens of KV (its
    new one included; whatever the blocks hold: the time, not the values, is wanted), and a
    chunk of ``prompt_tokens`` (a prompt alone: step_budget's prefill, split at
    ``max_model_len``)."""
    if not decode_seqs:
        return time_prefill(runner, blocks, prompt_tokens, max_model_len)
    seqs = [
        Sequence(f"step-model-probe-{i}", [0] * context, SamplingParams(max_tokens=1))
        for i in range(decode_seqs)
    ]
    chunks = [1] * decode_seqs
    if prompt_tokens:
        n = min(prompt_tokens, max_model_len)
        seqs.append(Sequence("step-model-probe-prompt", [0] * n, SamplingParams(max_tokens=1)))
        chunks.append(n)
    return time_probe_step(runner, blocks, seqs, chunks)
