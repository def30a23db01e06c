"""The messages of an embedding request (``/v1/embeddings``); no KV, no decode pool::

    gateway ── Embed ─▶ coordinator ── Embed ─▶ embed worker ── EmbedResult ─▶ gateway
                                    ◀── Finished (or RequestError) ──┘

An embed worker is a prefill-only worker of an embedding model (it registers as role
``embed``, with a prefill key); the coordinator picks the least busy one of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.codec import Message, message
from pdserve.protocol.tenancy import Share

MAX_EMBED_INPUTS = 2048  # inputs in one request (OpenAI's own limit)
MAX_EMBED_DIM = 1 << 16


@message("embed")
@dataclass(frozen=True, kw_only=True)
class Embed(Message):
    """Gateway → coordinator → embed worker: the inputs' token ids (the model's special
    tokens included), each within the model's length."""

    request_id: str
    model: str
    inputs: list[list[int]]
    stream_address: str  # the gateway's: the result goes straight there
    share: Share | None = None

    def __post_init__(self) -> None:
        if not 1 <= len(self.inputs) <= MAX_EMBED_INPUTS:
            raise ValueError(f"an embed request has 1 to {MAX_EMBED_INPUTS} inputs")
        if not all(self.inputs):
            raise ValueError("an embed input has no tokens")


@message("embed_result")
@dataclass(frozen=True, kw_only=True)
class EmbedResult(Message):
    """Embed worker → gateway: one vector per input, in order, as float32 little-endian rows
    (``len(inputs) * dim * 4`` bytes, sent as a frame of its own)."""

    request_id: str
    dim: int
    vectors: bytes
    num_tokens: int  # the inputs' tokens, for usage

    def __post_init__(self) -> None:
        if not 1 <= self.dim <= MAX_EMBED_DIM or len(self.vectors) % (4 * self.dim):
            raise ValueError(f"{len(self.vectors)} bytes are no whole rows of {self.dim} floats")
