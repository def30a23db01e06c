"""The coordinator's routes: one per live choice, found by key or by request id."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from pdserve.protocol import messages as m

Key = tuple[str, int]  # (request_id, choice)


@dataclass
class Route:
    request: m.Generate
    choice: int
    state: str  # queued | reserving | prefilling | decoding | local
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

    def members(self) -> range:
        return range(self.choice, self.choice + self.choices)


class RouteTable(Mapping[Key, Route]):
    """Routes by ``(request_id, choice)``, with each request's choices indexed so an abort or
    a worker error costs O(n) in its own choices, not a scan of every request in flight."""

    def __init__(self) -> None:
        self._routes: dict[Key, Route] = {}
        self._choices: dict[str, set[int]] = {}

    def add(self, route: Route) -> None:
        key = (route.request.request_id, route.choice)
        self._routes[key] = route
        self._choices.setdefault(key[0], set()).add(key[1])

    def pop(self, key: Key) -> Route:
        route = self._routes.pop(key)
        choices = self._choices[key[0]]
        choices.discard(key[1])
        if not choices:
            del self._choices[key[0]]
        return route

    def keys_of(self, request_id: str, choice: int | None = None) -> list[Key]:
        """The live keys of one request: every choice, or just ``choice``."""
        choices = self._choices.get(request_id, ())
        return [(request_id, c) for c in sorted(choices) if choice in (None, c)]

    def covering(self, request_id: str, choice: int) -> Route | None:
        """The route of ``choice``: its own, or that of the choices it goes with."""
        for c in sorted(self._choices.get(request_id, ()), reverse=True):
            if c <= choice:
                route = self._routes[(request_id, c)]
                return route if choice in route.members() else None
        return None

    def __getitem__(self, key: Key) -> Route:
        return self._routes[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._routes)

    def __len__(self) -> int:
        return len(self._routes)
