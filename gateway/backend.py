"""What the gateway needs from the workers behind it, and nothing about how they are reached.

The ZMQ client (gateway -> coordinator, token stream back from the workers) implements
``Backend``; unit tests implement it with a scripted fake. It speaks the wire's own types
(``protocol.messages``), passed on as they came: a request is a ``Generate`` (one prompt, ``n``
choices; the app leaves ``stream_address`` empty, the backend fills in its own), a model is a
``ServedModel``, a worker's load a ``WorkerStatus``, tokens come as ``TokenChunk``s.

The contract:

- ``await submit(request)`` admits the request or raises ``BackendError`` (overloaded: 429,
  unavailable: 503) before any token exists; it returns the request's token stream.
- The stream yields the ``TokenChunk``s of all ``n`` choices, interleaved; each choice's in
  index order, every token once (``gateway.token_streams.ChoiceOrder`` makes them so: token 0
  of a choice comes from the prefill worker, tokens 1.. from the decode worker, and either may
  come first; a migrated choice's new worker may repeat tokens). Nothing is reordered after
  the backend.
- Each choice ends with exactly one chunk that has ``finished`` set and a ``finish_reason``:
  ``"length"`` (max tokens or context), or ``"stop"`` when the last token of that chunk is an
  eos / stop token id (the gateway counts it but never shows its text); for any other reason
  (an abort the gateway never asked for) the backend raises instead. The stream ends after the
  last choice's final chunk. A failure mid-stream raises ``BackendError`` from the iterator.
- ``await abort(request_id)`` stops every choice of the request and frees its blocks; it is
  idempotent and may be called after the request finished.
- ``models()`` lists the models ready to serve (``ServedModel.ready``), and only those.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator

from pdserve.protocol import messages as m


class BackendError(Exception):
    """A failure the client should see; ``status`` is the HTTP status (429, 503 or 500)."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Backend(abc.ABC):
    """The cluster behind the gateway: where requests go and tokens come from."""

    @abc.abstractmethod
    async def submit(self, request: m.Generate) -> AsyncIterator[m.TokenChunk]:
        """Admit ``request`` (or raise ``BackendError``) and return its token stream."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    async def embed(self, request: m.Embed, timeout_s: float | None) -> m.EmbedResult:
        """The embeddings of ``request`` (``stream_address`` the backend's), or
        ``BackendError``; within ``timeout_s`` (None: no bound) or a 504."""
        raise BackendError("this backend serves no embeddings", 501)

    @abc.abstractmethod
    def models(self) -> list[m.ServedModel]: ...

    @abc.abstractmethod
    def health(self) -> bool: ...

    def worker_stats(self) -> list[m.WorkerStatus]:
        """Load of every worker, for ``/metrics``."""
        return []

    def routing_decisions(self) -> dict[str, int]:
        """The coordinator's routing decisions so far by reason, for ``/metrics``."""
        return {}

    def plans(self) -> list[m.PlanReport]:
        """The planner's latest plan per model, for ``/metrics`` and ``GET /planner``."""
        return []

    def rollouts(self) -> list[m.Rollout]:
        """Each model name's versions and their weights (``gateway.versions``)."""
        return []
