"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence of
the sequence's last n tokens, in its prompt or its output so far (longest n first).

The index of one sequence maps every n-gram (``n_min <= n <= n_max``) that has a token after
it to where that token is, the latest occurrence winning; it is brought up to date with only
the tokens added since the last proposal (``num_indexed``), never rebuilt::

    tokens   a b c d a b c e a b
                           ▲ suffix "a b": its latest earlier occurrence ends at 6,
                             so the proposal is tokens[6:6+k] = "c e a b"[:k] (past the end,
                             the copy repeats itself)
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """One sequence's n-gram positions (see the module docstring)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self.num_indexed = 0  # n-grams ending before this index are in ``after``

    def update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams that gained a token after them since the last call."""
        after, lo, hi = self.after, self.n_min, self.n_max
        for end in range(max(self.num_indexed, 1), len(tokens)):
            for n in range(lo, min(hi, end) + 1):
                after[tuple(tokens[end - n : end])] = end
        self.num_indexed = max(self.num_indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """``k`` tokens that followed the longest matching suffix, and that suffix's length
        (its kind: longer matches are kept more often); ([], 0) when none matched."""
        self.update(tokens)
        total = len(tokens)
        for n in range(min(self.n_max, total), self.n_min - 1, -1):
            start = self.after.get(tuple(tokens[total - n :]))
            if start is not None:
                return _copy(tokens, start, k), n
        return [], 0


def _copy(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start`` on; past the end, the copy goes on from itself (a copy that
    overlaps its source repeats the pattern, as LZ77's does: "a b a b" + "a b" ...)."""
    total = len(tokens)
    out: list[int] = []
    for i in range(k):
        j = start + i
        out.append(tokens[j] if j < total else out[j - total])
    return out
