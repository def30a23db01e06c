"""The coordinator's routes: one per live choice, found by key or by request id.

A route's state (``RouteState``)::

    queued ──▶ reserving ──Reserved──▶ prefilling ──TransferDone──▶ decoding ──Finished──▶ ·
      ▲            │ refused, timed out, worker lost: another decode worker is asked (a new
      └────────────┘ route), or the choice waits in the queue
    local: one worker runs both phases, no transfer (conditional disaggregation, a colocated
    pool, a choice resumed after its worker died), from the start to ``Finished``
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum

from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey


class RouteState(Enum):
    QUEUED = "queued"  # no decode worker has the blocks now: waits, first come first served
    RESERVING = "reserving"  # a decode worker was asked to hold blocks (``Reserve``)
    PREFILLING = "prefilling"  # blocks held; a prefill worker computes and pushes the KV
    DECODING = "decoding"  # the KV arrived (``TransferDone``): the decode worker streams
    LOCAL = "local"  # one worker runs both phases, no transfer


@dataclass
class Route:
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

    @property
    def key(self) -> ChoiceKey:
        return ChoiceKey(self.request.request_id, self.choice)

    def members(self) -> range:
        return range(self.choice, self.choice + self.choices)

    def workers(self) -> set[str]:
        """The workers this route holds something on."""
        return {self.decode, self.prefill} - {""}


class RouteTable(Mapping[ChoiceKey, Route]):
    """Owns every live route, keyed by ``ChoiceKey``, with each request's choices indexed so an
    abort or a worker error costs O(n) in its own choices, not a scan of every request in
    flight."""

    def __init__(self) -> None:
        self._routes: dict[ChoiceKey, Route] = {}
        self._choices: dict[str, set[int]] = {}

    def add(self, route: Route) -> None:
        key = route.key
        self._routes[key] = route
        self._choices.setdefault(key.request_id, set()).add(key.choice)

    def pop(self, key: ChoiceKey) -> Route:
        route = self._routes.pop(key)
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
