"""What the prefill and the decode worker share, and what worker/process.py drives either by.

Each keeps one table of request records (``records``, keyed by ``ChoiceKey``, each with an
``Enum`` state) and has no sockets: ``handle`` takes a message, ``step`` runs one engine step,
and everything it says goes through an ``Outbox``.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from pdserve.engine.engine import LLMEngine
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey
from pdserve.runtime.tracing import NO_TRACER, Tracer
from pdserve.worker.wire import Outbox, TokenBatcher, TransferStats

logger = logging.getLogger(__name__)


class Record(Protocol):
    """A request's record on a worker: whatever else it holds, a state."""

    @property
    def state(self) -> enum.Enum: ...


R = TypeVar("R", bound=Record, covariant=True)


class Worker(ABC, Generic[R]):
    """A worker around one engine. Owns its table of request records (one per key: a request's
    state lives nowhere else on the worker), the step's token batcher, and the draining flag
    (set on SIGTERM: new work is turned away, what is here finishes)."""

    transfers: TransferStats | None = None  # KV pushed to other workers (heartbeat counters)

    def __init__(self, engine: LLMEngine, worker_id: str, outbox: Outbox) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.outbox = outbox
        self.tokens = TokenBatcher(outbox)  # this step's chunks, one message per gateway
        self.draining = False
        self.records: dict[ChoiceKey, R] = {}
        self.kv_failures = 0  # KV transfers that failed here: pushes, or KV received broken
        self.tracer: Tracer = NO_TRACER  # its spans (``--otlp-endpoint``: runtime/tracing.py)
        self.step_started = 0.0  # time.monotonic() when the current (or last) step began

    @abstractmethod
    def handle(self, msg: m.Message) -> None:
        """Act on one control message (coordinator to worker)."""

    @abstractmethod
    def step(self) -> bool:
        """One step of work; whether there was anything to do."""

    def begin_drain(self) -> None:
        """Finish what is here; new work is turned away (the coordinator stops sending it)."""
        self.draining = True

    def in_flight(self) -> bool:
        return bool(self.records)

    def keys_in(self, state: enum.Enum) -> list[ChoiceKey]:
        """The keys of the records in ``state``, in arrival order."""
        return [key for key, record in self.records.items() if record.state is state]

    def prompt_started(self, engine_id: Hashable) -> bool:
        """Whether the engine has begun computing this prompt (a chunk of it scheduled)."""
        seq = self.engine.requests.live.get(engine_id)
        return seq is not None and seq.num_computed_tokens > 0

    @property
    def queued_prompt_tokens(self) -> int:
        return self.engine.status.queued_prompt_tokens

    def _finished(self, key: ChoiceKey) -> None:
        """Tell the coordinator a choice ended here (its route is done)."""
        finished = m.Finished(
            request_id=key.request_id, choice=key.choice, worker_id=self.worker_id
        )
        self.outbox.to_coordinator(finished)

    def _fail(self, key: ChoiceKey, stream_address: str, status: int, message: str) -> None:
        """End a request with an error, to its gateway (after this step's tokens) and to the
        coordinator."""
        logger.warning("request %s failed: %s", key, message)
        error = m.RequestError(request_id=key.request_id, status=status, message=message)
        self.tokens.flush()
        self.outbox.to_gateway(stream_address, error)
        self.outbox.to_coordinator(error)
