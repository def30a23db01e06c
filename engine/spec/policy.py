"""When speculation pays: a pure policy over the step-time model and measured acceptance.

A step of ``D`` decodes and ``P`` prompt tokens takes ``T(P, D)`` (engine/step_model.py) and
yields ``D`` tokens. Verifying ``k_s`` drafts of sequence ``s`` adds ``k_s`` rows (priced as
prompt tokens: a verification is a short chunk) and, with a draft model, its ``k`` passes;
it yields ``e_s`` more tokens, the drafts expected to be kept::

    e_s = r + r^2 + ... + r^k_s     r: the sequence's acceptance rate, its own drafts so far
                                        blended with the worker's (``Acceptance``)

Each sequence verifies only the drafts worth a row (``worth_drafting``: the j-th brings
``r^j`` tokens); sequences go in by ``e_s / k_s``, best first; the step speculates on the
prefix that gives the most tokens a second, if that beats ``D / T(P, D)`` by ``MARGIN``. At
large batches the rows cost as much as the tokens they may bring, and with low acceptance they
bring few: off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.step_model import StepCosts

MARGIN = 0.05  # predicted gain a step must show to speculate (noise in the model, not a win)
PRIOR_RATE = 0.3  # a kind of proposal's acceptance rate before the worker has measured one
PRIOR_WEIGHT = 8.0  # drafts that prior counts as
SEQ_PRIOR_WEIGHT = 4.0  # drafts the worker's rate counts as in a sequence's own
DECAY = 0.99  # a verdict's weight in the worker's rate fades by this each later one: it
# follows the traffic of the last hundred or so (a copy-heavy spell says little of chat next)


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


def worth_drafting(rate: float, drafts: int, costs: StepCosts, prompt: int, decodes: int) -> int:
    """How many of ``drafts`` are worth a row: the j-th brings ``rate^j`` tokens, each worth
    what a token of the step without speculation costs; a row costs a prompt token's time."""
    if decodes <= 0:
        return 0
    token_s = costs.seconds(prompt, decodes) / decodes
    worth, term = 0, 1.0
    for _ in range(drafts):
        term *= rate
        if term * token_s <= costs.per_prefill_token_s:
            break
        worth += 1
    return worth


def choose(
    candidates: Sequence[Candidate],
    costs: StepCosts,
    prompt_tokens: int,
    decode_seqs: int,
    draft_seconds: Callable[[int], float] = lambda seqs: 0.0,
    verify_s: float = 0.0,
) -> list[int]:
    """Indices of ``candidates`` to speculate on this step ([]: none pays).
    ``draft_seconds(seqs)``: what drafting for that many sequences costs (0: n-gram);
    ``verify_s``: what a step that verifies pays on top of its rows (the sampler position by
    position, measured)."""
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
        seconds += verify_s
        rate = tokens / max(seconds, 1e-9)
        if rate > best_rate:
            best, best_rate = taken, rate
    return sorted(order[:best])


class Acceptance:
    """The worker's acceptance: per draft position, drafts verified and kept since start (the
    metrics), and fading rates by kind of proposal (what a sequence is expected to keep before
    it has shown its own): an n-gram proposal's kind is the length of the match that found it
    (a 4-token match is kept far more often than a 2-token one), a draft model's is 0.
    Each sequence's own counts live in its ``SeqSpec``."""

    def __init__(self, positions: int) -> None:
        self.drafted = [0] * positions
        self.accepted = [0] * positions
        self._seen: dict[int, float] = {}
        self._kept: dict[int, float] = {}

    def rate(self, kind: int = 0) -> float:
        """Kept / reached drafts of ``kind``, recent ones weighing most (a draft is reached only
        when those before it were kept: a conditional rate)."""
        seen = self._seen.get(kind, PRIOR_WEIGHT)
        return self._kept.get(kind, PRIOR_RATE * PRIOR_WEIGHT) / seen

    def record(self, drafts: int, kept: int, kind: int = 0) -> None:
        """A sequence verified ``drafts`` drafts of ``kind`` and kept the first ``kept``."""
        for position in range(min(drafts, len(self.drafted))):
            self.drafted[position] += 1
            self.accepted[position] += position < kept
        self.observe(min(drafts, kept + 1), kept, kind)

    def observe(self, tested: int, kept: int, kind: int = 0) -> None:
        """Into the rate alone: ``tested`` drafts reached (the kept ones and a first miss),
        ``kept`` kept (a verification, or a proposal checked against the tokens that came)."""
        seen = self._seen.get(kind, PRIOR_WEIGHT)
        self._seen[kind] = seen * DECAY + tested
        self._kept[kind] = self._kept.get(kind, PRIOR_RATE * PRIOR_WEIGHT) * DECAY + kept

    def seq_rate(self, drafted: int, kept: int, kind: int = 0) -> float:
        """A sequence's rate: its own tested drafts blended with the worker's for ``kind``."""
        prior = self.rate(kind)
        return (kept + SEQ_PRIOR_WEIGHT * prior) / (drafted + SEQ_PRIOR_WEIGHT)
