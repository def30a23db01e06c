"""Sampling parameters (OpenAI and vLLM semantics): one frozen type from the HTTP layer to the
sampler.

    gateway (built from the OpenAI request) ── Generate ─▶ coordinator ── Reserve, PrefillJob ─▶
    workers ─▶ engine (``Sequence.params``, read by the sampler)

It is made valid or not at all: construction raises ``ValueError`` naming the field, so the
codec, which rebuilds it on decode, turns a peer's out-of-range value into its own
``ProtocolError``. Nothing changes it after: ``dataclasses.replace`` makes a variant (a
choice's own seed). It lives in ``protocol`` so the torch-free roles share it with the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on the output (``engine.structured`` compiles it; one matcher per choice).

    ``kind`` "json": ``spec`` is a JSON Schema (``{"type": "object"}`` for OpenAI's
    json_object); "regex": a regular expression the whole output matches; "choice": a JSON list
    of strings, the output is one of them; "grammar": a Lark grammar or a GBNF/EBNF one.
    """

    kind: Literal["json", "regex", "choice", "grammar"]
    spec: str


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # over generated tokens (OpenAI)
    frequency_penalty: float = 0.0  # over generated tokens (OpenAI)
    repetition_penalty: float = 1.0  # over prompt and generated tokens (transformers)
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: off; k >= 0: sampled token plus top-k alternatives
    structured: StructuredSpec | None = None  # output constraint (``engine.structured``)

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the offending field (the gateway reports it as the
        request's ``param``)."""
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
