"""One simulated request: when it arrives, its lengths, the prefixes it may find cached, its
tier. Every workload (sim/workload.py) turns into a list of these, in arrival order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    """``prefixes``: (key, tokens) pairs, shortest first, each a prefix of this prompt that an
    earlier request may have left in a worker's prefix cache (a shared system prompt, then the
    conversation so far); ``key``: what this request's prompt plus output is cached as (the
    prefix a later turn of its conversation names). ``tier``: lower is served first (0 is the
    top tier), as the fair queue orders them. ``kind``: a label the results are split by
    (``stream``, ``burst``, ...)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefixes: tuple[tuple[str, int], ...] = ()
    key: str | None = None
    tier: int = 0
    kind: str = ""

    def __post_init__(self) -> None:
        if not self.arrival_s >= 0:
            raise ValueError(f"arrival_s must be >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")
        for key, tokens in self.prefixes:
            if not 0 < tokens <= self.prompt_tokens:
                raise ValueError(
                    f"prefix {key!r}: {tokens} tokens, not within the prompt's {self.prompt_tokens}"
                )
        if self.tier < 0:
            raise ValueError(f"tier must be >= 0, got {self.tier}")
