"""Conditional disaggregation: whether a prompt is prefilled by its decode worker itself (no KV
transfer) rather than by a prefill worker. A pure decision; ``coordinator.local`` acts on it.

    local_short_prompt   the part of the prompt not cached on its decode worker is at most
                         ``max_local_prefill_tokens`` (a conversation's next turn is short even
                         when its history is long)
    local_prefill_busy   every answering prefill worker has more than
                         ``max_prefill_queue_tokens`` prompt tokens queued

0 turns either rule off (the default: every prompt goes through a prefill worker).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class LocalReason(Enum):
    """Why a prompt is prefilled where it decodes (counted in
    ``pdserve_routing_decisions_total`` by its value)."""

    SHORT_PROMPT = "local_short_prompt"
    PREFILL_BUSY = "local_prefill_busy"


@dataclass(frozen=True)
class ConditionalDisaggPolicy:
    """The two thresholds, in prompt tokens (0: that rule off)."""

    max_local_prefill_tokens: int = 0
    max_prefill_queue_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_local_prefill_tokens < 0 or self.max_prefill_queue_tokens < 0:
            raise ValueError("the local-prefill thresholds must be >= 0 (0: off)")

    @property
    def enabled(self) -> bool:
        return self.max_local_prefill_tokens > 0 or self.max_prefill_queue_tokens > 0

    def reason(
        self,
        prompt_tokens: int,
        decode_cached_tokens: int,
        prefill_queue_tokens: int | None,
    ) -> LocalReason | None:
        """Why a prompt of ``prompt_tokens``, ``decode_cached_tokens`` of them cached on the
        decode worker that would take it, is prefilled there while the shortest prefill queue
        holds ``prefill_queue_tokens`` (None: no prefill worker answers); None: by a prefill
        worker."""
        limit = self.max_local_prefill_tokens
        if limit > 0 and prompt_tokens > 0 and prompt_tokens - decode_cached_tokens <= limit:
            return LocalReason.SHORT_PROMPT
        busy = self.max_prefill_queue_tokens
        if busy > 0 and prefill_queue_tokens is not None and prefill_queue_tokens > busy:
            return LocalReason.PREFILL_BUSY
        return None
