"""The key of one choice of one request, wherever a table holds per-choice state (the
coordinator's routes, a worker's request records, the engine's sequences)."""

from __future__ import annotations

from typing import NamedTuple


class ChoiceKey(NamedTuple):
    request_id: str
    choice: int

    def __str__(self) -> str:  # for logs: "req-1#2"
        return f"{self.request_id}#{self.choice}"
