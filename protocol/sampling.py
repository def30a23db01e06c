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
# Prompt logprobs come back in one message and one response: (prompt tokens - 1) x (k + 1)
# entries at most (about 3 MB on the wire at the limit, under the control plane's 8 MiB).
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 16


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
    # None: off; k >= 0: each prompt token's logprob (from position 1) plus top-k alternatives
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None  # output constraint (``engine.structured``)

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the offending field (the gateway reports it as the
        request's ``param``)."""
        checks = [
            # 0: no output, only the prompt scored (echo with logprobs, prompt_logprobs)
            (
                self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
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
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def check_prompt_logprobs(self, prompt_tokens: int) -> None:
        """``ValueError`` when the prompt's logprobs would be more than one answer carries."""
        if self.prompt_logprobs is None:
            return
        entries = max(prompt_tokens - 1, 0) * (self.prompt_logprobs + 1)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise ValueError(
                f"prompt logprobs of {prompt_tokens} tokens with {self.prompt_logprobs} "
                f"alternatives each are {entries} entries, over the limit of "
                f"{MAX_PROMPT_LOGPROB_ENTRIES}: ask fewer alternatives or a shorter prompt"
            )

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
