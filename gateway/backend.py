"""What the gateway needs from the workers behind it, and nothing about how they are reached.

The ZMQ client (gateway -> coordinator, token stream back from the workers) implements
``Backend``; unit tests implement it with a scripted fake. The contract:

- ``await submit(request)`` admits the request or raises ``BackendError`` (overloaded: 429,
  unavailable: 503) before any token exists; it returns the request's token stream.
- The stream yields the ``TokenChunk``s (``protocol.messages``, the wire's type, passed on as it
  came) of all ``n`` choices, interleaved; each choice's in index order, every token once
  (``gateway.reorder.ChoiceOrder`` makes them so: token 0 of a choice comes from the prefill
  worker, tokens 1.. from the decode worker, and either may come first; a migrated choice's
  new worker may repeat tokens). Nothing is reordered after the backend.
- Each choice ends with exactly one chunk that has ``finished`` set and a ``finish_reason``:
  ``"length"`` (max tokens or context), or ``"stop"`` when the last token of that chunk is an
  eos / stop token id (the gateway counts it but never shows its text); for any other reason
  (an abort the gateway never asked for) the backend raises instead. The stream ends after the
  last choice's final chunk. A failure mid-stream raises ``BackendError`` from the iterator.
- ``await abort(request_id)`` stops every choice of the request and frees its blocks; it is
  idempotent and may be called after the request finished.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    n: int = 1


@dataclass(frozen=True)
class ModelInfo:
    id: str  # served model name
    root: str  # where the weights live
    max_model_len: int
    created: int = 0


@dataclass(frozen=True)
class WorkerStats:
    role: str  # "prefill" | "decode"
    worker: str
    kv_blocks_used: int
    kv_blocks_total: int
    requests_running: int
    requests_waiting: int
    counters: m.WorkerCounters = field(default_factory=m.WorkerCounters)  # totals since start


class BackendError(Exception):
    """A failure the client should see; ``status`` is the HTTP status (429, 503 or 500)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Backend(abc.ABC):
    @abc.abstractmethod
    async def submit(self, request: GenerateRequest) -> AsyncIterator[m.TokenChunk]:
        """Admit ``request`` (or raise ``BackendError``) and return its token stream."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def models(self) -> list[ModelInfo]: ...

    @abc.abstractmethod
    def health(self) -> bool: ...

    def worker_stats(self) -> list[WorkerStats]:
        """Load of every worker, for ``/metrics``."""
        return []

    def routing_decisions(self) -> dict[str, int]:
        """The coordinator's routing decisions so far by reason, for ``/metrics``."""
        return {}
