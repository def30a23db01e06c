"""Verification: the target's logits at each of a sequence's ``k + 1`` positions decide which
of its ``k`` drafts it keeps.

    input    [last, d1, d2, d3, d4]      one forward pass, logits at every position
    logits   [  L0,  L1,  L2,  L3,  L4]  L_j predicts the token after d_j (d_0 = last)
    sample   t0 = S(L0); t0 == d1? keep it, t1 = S(L1); t1 == d2? ... up to t4 (a bonus)
    emitted  t0 .. t_m: the m drafts kept, then the target's own token where the first draft
             was refused (or the bonus after all k)

``S`` is the engine's sampler applied to one position at a time, each sequence in the state it
would be in had the tokens before come one step each: penalties count them, ``min_tokens``
sees them, the grammar's matcher has consumed them, a seeded generator has drawn once for each,
stop tokens and ``max_tokens`` end it where they would. So greedy output is token for token the
output without speculation, and a seeded sampled one is too (the same draws, in the same
order). For a deterministic proposer (n-gram, a greedy draft: q one-hot) "keep x when the
sampled token is x" is the standard acceptance rule: x is kept with probability p(x) =
min(1, p(x)/q(x)), and a refused position emits a sample of p without x, which is the
normalised max(0, p - q); the output distribution is the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Sequence
from pdserve.protocol.messages import TokenLogprob


@dataclass
class Verdict:
    """What one sequence's verification kept: ``accepted`` drafts, then one token of the
    target's own; ``emitted`` tokens in all (fewer when a stop ended it first)."""

    seq: Sequence
    drafts: list[int]
    accepted: int = 0
    emitted: int = 0


Emit = Callable[[Sequence, int, TokenLogprob | None], None]


def verify(
    checks: list[tuple[Sequence, torch.Tensor]], sampler: Sampler, emit: Emit
) -> list[Verdict]:
    """``checks``: each sequence with its ``[1 + len(spec_tokens), V]`` logits. ``emit``
    appends one token to a sequence (and ends it at a stop); position by position, every
    sequence still going is sampled in one batch."""
    verdicts = [Verdict(seq, list(seq.spec_tokens)) for seq, _ in checks]
    going = list(range(len(checks)))
    position = 0
    while going:
        rows = torch.stack([checks[i][1][position] for i in going])  # [G, V]
        sampled = sampler(rows, [verdicts[i].seq for i in going])
        still: list[int] = []
        for i, token, logprob in zip(going, sampled.token_ids, sampled.logprobs, strict=True):
            v = verdicts[i]
            emit(v.seq, token, logprob)
            v.emitted += 1
            if position < len(v.drafts) and token == v.drafts[position] and not v.seq.is_finished:
                v.accepted += 1
                still.append(i)
        going = still
        position += 1
    return verdicts
