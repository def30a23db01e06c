"""When speculation pays: a pure policy over the step-time model and measured acceptance.

A step of ``D`` decodes and ``P`` prompt tokens takes ``T(P, D)`` (engine/step_model.py) and
yields ``D`` tokens. Verifying ``k_s`` drafts of sequence ``s`` adds ``k_s`` rows (priced as
prompt tokens: a verification is a short chunk) and, with a draft model, its ``k`` passes;
it yields ``e_s`` more tokens, the drafts expected to be kept::

    e_s = r + r^2 + ... + r^k_s     r: the sequence's acceptance rate, its own drafts so far
                                        blended with the worker's (``Acceptance``)

Sequences go in by ``e_s / k_s``, best first; the step speculates on the prefix that gives
the most tokens a second, if that beats ``D / T(P, D)`` by ``MARGIN``. At large batches the
rows cost as much as the tokens they may bring, and with low acceptance they bring few: off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.step_model import StepCosts

MARGIN = 0.03  # predicted gain a step must show to speculate (noise in the model, not a win)
PRIOR_RATE = 0.5  # the worker's acceptance rate before it has measured one
PRIOR_WEIGHT = 8.0  # drafts that prior counts as
SEQ_PRIOR_WEIGHT = 4.0  # drafts the worker's rate counts as in a sequence's own
DECAY = 0.998  # a verified sequence's weight in the worker's rate fades by this each verdict


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence that could verify ``drafts`` drafts, expecting ``expected`` kept."""

    drafts: int
    expected: float


def expected_kept(rate: float, drafts: int) -> float:
    """Drafts expected to be kept of ``drafts``, each kept with ``rate`` once those before
    were: ``rate + rate^2 + ... + rate^drafts``."""
    total, term = 0.0, 1.0
    for _ in range(drafts):
        term *= rate
        total += term
    return total


def choose(
    candidates: Sequence[Candidate],
    costs: StepCosts,
    prompt_tokens: int,
    decode_seqs: int,
    draft_seconds: Callable[[int], float] = lambda seqs: 0.0,
) -> list[int]:
    """Indices of ``candidates`` to speculate on this step ([]: none pays).
    ``draft_seconds(seqs)``: what drafting for that many sequences costs (0: n-gram)."""
    if not candidates or decode_seqs <= 0:
        return []
    base = decode_seqs / max(costs.seconds(prompt_tokens, decode_seqs), 1e-9)
    order = sorted(
        range(len(candidates)),
        key=lambda i: candidates[i].expected / max(candidates[i].drafts, 1),
        reverse=True,
    )
    best, best_rate = 0, base * (1.0 + MARGIN)
    rows, tokens = 0, float(decode_seqs)
    for taken, i in enumerate(order, start=1):
        rows += candidates[i].drafts
        tokens += candidates[i].expected
        seconds = costs.seconds(prompt_tokens + rows, decode_seqs) + draft_seconds(taken)
        rate = tokens / max(seconds, 1e-9)
        if rate > best_rate:
            best, best_rate = taken, rate
    return sorted(order[:best])


class Acceptance:
    """The worker's acceptance: per draft position, drafts verified and kept since start (the
    metrics), and a fading rate over all positions (what a new sequence is expected to keep).
    Each sequence's own counts live in its ``SeqSpec``."""

    def __init__(self, positions: int) -> None:
        self.drafted = [0] * positions
        self.accepted = [0] * positions
        self._seen = PRIOR_WEIGHT
        self._kept = PRIOR_RATE * PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        """Kept / verified drafts, recent ones weighing most (a draft reached only when those
        before it were kept: a conditional rate)."""
        return self._kept / self._seen

    def record(self, drafts: int, kept: int) -> None:
        """A sequence verified ``drafts`` drafts and kept the first ``kept``."""
        for position in range(min(drafts, len(self.drafted))):
            self.drafted[position] += 1
            self.accepted[position] += position < kept
        self.observe(min(drafts, kept + 1), kept)

    def observe(self, tested: int, kept: int) -> None:
        """Into the rate alone: ``tested`` drafts reached (the kept ones and a first miss),
        ``kept`` kept (a verification, or a proposal checked against the tokens that came)."""
        self._seen = self._seen * DECAY + tested
        self._kept = self._kept * DECAY + kept

    def seq_rate(self, drafted: int, kept: int) -> float:
        """A sequence's rate: its own tested drafts blended with the worker's rate."""
        return (kept + SEQ_PRIOR_WEIGHT * self.rate) / (drafted + SEQ_PRIOR_WEIGHT)
