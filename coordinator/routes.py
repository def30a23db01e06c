"""The coordinator's routes, one per live choice, and what its parts share (``Shared``: the
registry, the route table, the silent workers and the outbox, with the sends every part
makes). A route's state changes only here, through its transitions (``Route``).

A route's state (``RouteState``)::

    queued ──▶ reserving ──Reserved──▶ prefilling ──TransferDone──▶ decoding ──Finished──▶ ·
      ▲            │ refused, timed out, worker lost: another decode worker is asked (a new
      └────────────┘ route), or the choice waits in the queue
    local: one worker runs both phases, no transfer (conditional disaggregation, a colocated
    pool, a choice resumed after its worker died), from the start to ``Finished``

The queued routes wait in a fair queue (pdserve/fair_queue.py): by their request's ``share``
(tier, then the tenants' weighted shares of prompt tokens, then priority and arrival).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from pdserve.coordinator.registry import WorkerRegistry
from pdserve.fair_queue import FairQueue
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey
from pdserve.protocol.tenancy import share_of
from pdserve.runtime.tracing import NO_TRACER, Tracer

logger = logging.getLogger(__name__)

SILENT_HOLD_S = 30.0  # a worker that let a reservation time out gets no new one this long


class RouteState(Enum):
    QUEUED = "queued"  # no decode worker has the blocks now: waits (``RouteTable.queued``)
    RESERVING = "reserving"  # a decode worker was asked to hold blocks (``Reserve``)
    PREFILLING = "prefilling"  # blocks held; a prefill worker computes and pushes the KV
    DECODING = "decoding"  # the KV arrived (``TransferDone``): the decode worker streams
    LOCAL = "local"  # one worker runs both phases, no transfer


class RouteStateError(RuntimeError):
    """A transition asked of a route in another state than the one it leaves (a bug)."""


@dataclass
class Route:
    """One choice's route (or, until they decode, the ``choices`` that go with it). Its state
    changes only through the transitions below, each checking the state it leaves; a route
    is made in its first state by ``queued``, ``reserving`` or ``local``."""

    request: m.Generate
    choice: int
    state: RouteState
    decode: str = ""
    prefill: str = ""
    job: m.PrefillJob | None = None  # kept to re-send if its prefill worker dies
    since: float = 0.0  # when it entered its state (queued, reserving, prefilling time out)
    need: int = 0  # decode blocks asked for while reserving
    tried: set[str] = field(default_factory=set)  # workers that refused or never answered
    # choices ``choice .. choice + choices - 1`` go as one until they decode: one reservation,
    # one prefill, one transfer (``TransferDone`` splits them into a route each)
    choices: int = 1
    ended: set[int] = field(default_factory=set)  # of those, the ones token 0 ended
    arrived: float = 0.0  # when it was made, or held before (its coordinator_wait and span start)

    @property
    def key(self) -> ChoiceKey:
        return ChoiceKey(self.request.request_id, self.choice)

    def members(self) -> range:
        return range(self.choice, self.choice + self.choices)

    def workers(self) -> set[str]:
        """The workers this route holds something on."""
        return {self.decode, self.prefill} - {""}

    # ---- made in a first state ----------------------------------------------------------------
    @classmethod
    def queued(
        cls, req: m.Generate, choice: int, choices: int, need: int, now: float, arrived: float
    ) -> Route:
        """Waiting for ``need`` decode blocks (``RouteTable.queued``)."""
        return cls(
            req, choice, RouteState.QUEUED, since=now, need=need, choices=choices, arrived=arrived
        )

    @classmethod
    def reserving(
        cls,
        req: m.Generate,
        choice: int,
        choices: int,
        need: int,
        decode: str,
        tried: set[str],
        now: float,
        arrived: float,
    ) -> Route:
        """``decode`` was asked to hold ``need`` blocks."""
        return cls(
            req,
            choice,
            RouteState.RESERVING,
            decode=decode,
            since=now,
            need=need,
            tried=tried,
            choices=choices,
            arrived=arrived,
        )

    @classmethod
    def local(
        cls, req: m.Generate, choice: int, worker_id: str, now: float, arrived: float
    ) -> Route:
        """One worker runs both phases."""
        return cls(
            req,
            choice,
            RouteState.LOCAL,
            decode=worker_id,
            prefill=worker_id,
            since=now,
            arrived=arrived,
        )

    # ---- transitions --------------------------------------------------------------------------
    def _leave(self, state: RouteState, to: RouteState) -> None:
        if self.state is not state:
            raise RouteStateError(
                f"route {self.key}: {to.value} from {self.state.value}, not {state.value}"
            )

    def reserve_on(self, decode: str, now: float) -> None:
        """queued -> reserving: ``decode`` has the blocks now and is asked for them (the
        caller took the route out of the queue)."""
        self._leave(RouteState.QUEUED, RouteState.RESERVING)
        self.state, self.decode, self.since = RouteState.RESERVING, decode, now

    def prefill_on(self, prefill: str, job: m.PrefillJob, now: float) -> None:
        """reserving -> prefilling: the decode worker holds the blocks; ``prefill`` computes
        the prompt (``job``, kept to send again elsewhere)."""
        self._leave(RouteState.RESERVING, RouteState.PREFILLING)
        self.state, self.prefill, self.job, self.since = RouteState.PREFILLING, prefill, job, now

    def prefill_moves_to(self, prefill: str, now: float) -> None:
        """prefilling, still: its prefill worker is gone or silent; ``prefill`` takes the job."""
        self._leave(RouteState.PREFILLING, RouteState.PREFILLING)
        self.tried.add(self.prefill)
        self.prefill, self.since = prefill, now

    def decoding(self, ended: set[int], now: float) -> list[Route]:
        """prefilling -> decoding: the KV arrived; a route of its own for each choice going on
        (``ended``: those token 0 ended). This route ends (the caller drops it)."""
        self._leave(RouteState.PREFILLING, RouteState.DECODING)
        return [
            Route(
                self.request,
                c,
                RouteState.DECODING,
                decode=self.decode,
                prefill=self.prefill,
                since=now,
            )
            for c in self.members()
            if c not in ended
        ]


class RouteTable(Mapping[ChoiceKey, Route]):
    """Owns every live route, keyed by ``ChoiceKey``, with each request's choices indexed so an
    abort or a worker error costs O(n) in its own choices, not a scan of every request in
    flight; and the fair queue of the ``queued`` ones, in step with the table: a route added
    queued joins it (its cost: its prompt's tokens), one popped queued leaves it, and whoever
    takes one out of it (``queued.pop``) moves it to another state."""

    def __init__(self) -> None:
        self._routes: dict[ChoiceKey, Route] = {}
        self._choices: dict[str, set[int]] = {}
        self.queued: FairQueue[Route] = FairQueue()

    def add(self, route: Route) -> None:
        key = route.key
        replaced = self._routes.get(key)
        if replaced is not None:
            self.queued.remove(replaced)
        self._routes[key] = route
        self._choices.setdefault(key.request_id, set()).add(key.choice)
        if route.state is RouteState.QUEUED:
            req = route.request
            self.queued.push(route, share_of(req.share), len(req.prompt_token_ids))

    def pop(self, key: ChoiceKey) -> Route:
        route = self._routes.pop(key)
        if route.state is RouteState.QUEUED:
            self.queued.remove(route)
        choices = self._choices[key.request_id]
        choices.discard(key.choice)
        if not choices:
            del self._choices[key.request_id]
        return route

    def keys_of(self, request_id: str, choice: int | None = None) -> list[ChoiceKey]:
        """The live keys of one request: every choice, or just ``choice``."""
        choices = self._choices.get(request_id, ())
        return [ChoiceKey(request_id, c) for c in sorted(choices) if choice in (None, c)]

    def covering(self, request_id: str, choice: int) -> Route | None:
        """The route of ``choice``: its own, or that of the choices it goes with."""
        for c in sorted(self._choices.get(request_id, ()), reverse=True):
            if c <= choice:
                route = self._routes[ChoiceKey(request_id, c)]
                return route if choice in route.members() else None
        return None

    def in_state(self, state: RouteState) -> list[Route]:
        """The routes in ``state``, oldest first."""
        return [r for r in self._routes.values() if r.state is state]

    def __getitem__(self, key: ChoiceKey) -> Route:
        return self._routes[key]

    def __iter__(self) -> Iterator[ChoiceKey]:
        return iter(self._routes)

    def __len__(self) -> int:
        return len(self._routes)


# ---- what the parts share --------------------------------------------------------------------


class CoordinatorOutbox(Protocol):
    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None: ...

    def to_gateway(self, address: str, msg: m.Message) -> None: ...

    def forget_worker(self, worker_id: str) -> None: ...


class SilentWorkers:
    """Owns the workers that let a reservation or a prefill job time out, and when: they are
    passed over for new work until they answer again, register again, die, or
    ``hold_s`` passes."""

    def __init__(self, hold_s: float = SILENT_HOLD_S) -> None:
        self.hold_s = hold_s
        self._since: dict[str, float] = {}

    def mark(self, worker_id: str, now: float) -> None:
        self._since[worker_id] = now

    def heard(self, worker_id: str) -> None:
        """The worker answered (or is a new process): nothing holds it back."""
        self._since.pop(worker_id, None)

    def at(self, now: float) -> set[str]:
        """The workers still silent at ``now``."""
        return {wid for wid, at in self._since.items() if now - at < self.hold_s}


class Shared:
    """The state every part of the coordinator reads: the workers (``registry``), the routes
    and the silent workers; and the way out (``outbox``), with the sends every part makes: to
    a worker, an error to a gateway, the end of a request on every worker it touched. No
    clock: what needs the time takes ``now`` from the message or tick being handled."""

    def __init__(self, outbox: CoordinatorOutbox, registry: WorkerRegistry) -> None:
        self.outbox = outbox
        self.registry = registry
        self.routes = RouteTable()
        self.silent = SilentWorkers()
        self.tracer: Tracer = NO_TRACER  # its spans (``--otlp-endpoint``)
        # request id -> when it came to be held (coordinator/holds.py), while it is let go
        self.held_since: dict[str, float] = {}

    def avoid(self, now: float) -> set[str]:
        """Workers not to give new work at ``now``: the silent ones."""
        return self.silent.at(now)

    def arrival(self, req: m.Generate, now: float) -> float:
        """When ``req`` came to the coordinator: ``now``, or when it was held (a worker away)."""
        return self.held_since.get(req.request_id, now)

    def send(self, worker_id: str, msg: m.Message) -> None:
        worker = self.registry.workers.get(worker_id)
        if worker is not None:
            self.outbox.to_worker(worker_id, worker.info.control_address, msg)

    def trace_for(self, req: m.Generate, choice: int) -> str:
        """The trace context a worker's part of ``choice`` goes under: the coordinator's span
        of it (``traced``), or, tracing off here, the gateway's as it came."""
        return self.tracer.child(req.trace, f"{req.request_id}#{choice}")

    def traced(
        self, req: m.Generate, choice: int, arrived: float, now: float, decode: str, prefill: str
    ) -> None:
        """The coordinator's span of ``choice`` (tracing on): from the route made (the
        ``Generate`` handled, or asked again elsewhere) to its prefill job sent."""
        if self.tracer.enabled and req.trace:
            attrs: dict[str, str | int | float | bool] = {
                "pdserve.request_id": req.request_id,
                "pdserve.choice": choice,
                "pdserve.decode_worker": decode,
                "pdserve.prefill_worker": prefill,
                "pdserve.local": decode == prefill,
            }
            salt = f"{req.request_id}#{choice}"
            self.tracer.span("coordinator", req.trace, arrived, now, attrs, salt=salt)

    def error_to(self, req: m.Generate, status: int, message: str) -> None:
        logger.info("request %s: %d %s", req.request_id, status, message)
        error = m.RequestError(request_id=req.request_id, status=status, message=message)
        self.outbox.to_gateway(req.stream_address, error)

    def drop(self, request_id: str, choice: int | None, reason: str) -> set[str]:
        """Abort the routes of a request (one choice, or all) on every worker they touch;
        the gateways that were waiting on them."""
        gateways = set()
        for key in self.routes.keys_of(request_id, choice):
            route = self.routes.pop(key)
            gateways.add(route.request.stream_address)
            for worker_id in route.workers():
                abort = m.Abort(request_id=request_id, reason=reason, choice=route.choice)
                self.send(worker_id, abort)
        return gateways

    def fail(
        self, key: ChoiceKey, status: int, message: str, req: m.Generate | None = None
    ) -> None:
        """End a request on every worker its choices touched and tell its gateway (``req``:
        the request, when ``key`` has no route)."""
        route = self.routes.get(key)
        request = req or (route.request if route else None)
        if request is None:
            return
        self.drop(key.request_id, None, message)
        self.error_to(request, status, message)
