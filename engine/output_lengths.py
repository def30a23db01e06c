"""How long outputs run here, learned from the sequences that finished: the estimate of growth
that admission by need reads (a decode worker reserves a prompt's blocks, not ``max_tokens``'s,
and its sequences grow as they decode; README "KV by need").

A running sequence that has ``o`` output tokens and may have ``M`` is expected to produce

    remaining(o, M) = mean over the last ``window`` finished lengths L > o of min(L, M) - o

(the conditional mean: a sequence already past most outputs is expected to run on as the
longer ones did), or one block's worth of tokens when no finished length exceeds ``o``; with
nothing learned yet, ``prior`` tokens (0: admit on what is used now, and let preemption
correct it). Only sequences that ended by a stop or their length count (an abort says nothing
of how long an output runs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from pdserve.protocol.blocks import blocks_for

WINDOW = 512  # finished lengths kept


class Growing(Protocol):
    """What the estimate needs of a sequence."""

    block_table: list[int]

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...


class OutputLengths:
    """Owns the window of finished output lengths and the expectations drawn from it."""

    def __init__(self, block_size: int, max_seq_tokens: int, window: int = WINDOW) -> None:
        self.block_size = block_size
        self.max_seq_tokens = max_seq_tokens  # the longest a sequence may grow here
        self._lengths: deque[int] = deque(maxlen=window)

    def finished(self, num_output_tokens: int) -> None:
        """A sequence ended by a stop or its length after ``num_output_tokens`` tokens."""
        self._lengths.append(num_output_tokens)

    def remaining(self, num_output: int, max_tokens: int, num_tokens: int) -> int:
        """Tokens a sequence with ``num_output`` of ``max_tokens`` output tokens (``num_tokens``
        in all) is expected to add still."""
        room = max(0, min(max_tokens - num_output, self.max_seq_tokens - num_tokens))
        if not self._lengths or room == 0:
            return 0
        longer = [min(n, max_tokens) - num_output for n in self._lengths if n > num_output]
        expected = sum(longer) / len(longer) if longer else self.block_size
        return min(room, round(expected))

    def expected_output(self) -> int:
        """Output tokens a new sequence is expected to produce (0: nothing learned yet)."""
        if not self._lengths:
            return 0
        return round(sum(self._lengths) / len(self._lengths))

    def growth_blocks(self, seqs: Iterable[Growing]) -> int:
        """Blocks ``seqs`` are expected to take beyond those they hold."""
        total = 0
        for s in seqs:
            tokens = s.num_tokens + self.remaining(s.num_output_tokens, s.max_tokens, s.num_tokens)
            total += max(0, blocks_for(tokens, self.block_size) - len(s.block_table))
        return total
