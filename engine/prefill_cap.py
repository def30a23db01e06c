"""The stall-free rule a scheduler applies to prompt work (engine/scheduler.py): ``PrefillCap``,
the most prompt tokens a step may add beside its decodes and the age past which a prompt is
not held to it, and ``PrefillRoom``, one step's account of it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Sequence


@dataclass
class PrefillCap:
    """The stall-free rule: ``room(decode_seqs)``, the most prompt tokens a step with that many
    decodes may add. A prompt that has gone ``age_bound_s`` without a token computed (since it
    arrived, or since its last chunk) is overdue until its prompt is done: overdue prompts
    may take ``overdue_tokens`` more a step between them, past the room. Slow, never starved,
    and a step's overrun stays bounded (one block's prefill); a prompt that gets room every
    step is never overdue, however long it takes."""

    room: Callable[[int], int]
    age_bound_s: float = math.inf
    overdue_tokens: int = 16


class PrefillRoom:
    """One step's account of the cap: the prompt tokens still allowed beside its decodes
    (``left``; None: no limit, when there is no cap or no decode), the allowance overdue
    prompts have left past it, and what they took of it (``overdue_tokens``)."""

    def __init__(self, cap: PrefillCap | None, running: list[Sequence], now: float) -> None:
        self._decodes_left = sum(1 for s in running if s.is_decoding)
        self._cap = cap
        self._now = now
        self.left = cap.room(self._decodes_left) if cap and self._decodes_left else None
        self._overdue_left = cap.overdue_tokens if cap else 0
        self.overdue_tokens = 0

    def decodes_after(self, decoding: bool) -> int:
        """Decodes still to schedule after this sequence (their budget is kept)."""
        return self._decodes_left - decoding

    def take(self, seq: Sequence, n: int) -> int:
        """The prompt tokens ``seq`` may compute this step, of the ``n`` the budget allows."""
        if self.left is None:
            return n
        allowed = self.left + (self._overdue_left if self._overdue(seq) else 0)
        return min(n, allowed)

    def used(self, seq: Sequence, n: int, decoding: bool) -> None:
        """``seq`` computes ``n`` tokens this step. A decode's drafts beyond its one token
        (engine/spec/) take none of the prompt room: they bring tokens of their own, and the
        speculation policy priced them with the step's prompt work in it."""
        if decoding:
            self._decodes_left -= 1
            return
        seq.progress_s = self._now
        if self.left is not None:
            past = max(0, n - self.left)
            self.left -= n - past
            self._overdue_left -= past
            self.overdue_tokens += past

    def dropped(self, seq: Sequence) -> None:
        """``seq`` was preempted before its turn: a decode of it no longer comes."""
        if seq.is_decoding:
            self._decodes_left -= 1

    def _overdue(self, seq: Sequence) -> bool:
        assert self._cap is not None
        if not seq.overdue and seq.progress_s is not None:
            seq.overdue = self._now - seq.progress_s >= self._cap.age_bound_s
        return seq.overdue
