"""The event loop: callbacks at simulated times, run in time order (ties in the order they were
scheduled). Time is a float of seconds from the start of the run; nothing here reads a clock."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    """``now`` is the time of the event being run (0 before any)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()
        self.events = 0  # run so far

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at ``when`` (never before ``now``)."""
        heapq.heappush(self._queue, (max(when, self.now), next(self._order), fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float = float("inf"), max_events: int = 1 << 62) -> None:
        """Run events in time order until none is left, the next is past ``until`` or
        ``max_events`` have run (a bound on a run that would never end)."""
        queue = self._queue
        while queue and queue[0][0] <= until and self.events < max_events:
            when, _, fn, args = heapq.heappop(queue)
            self.now = when
            self.events += 1
            fn(*args)

    @property
    def pending(self) -> int:
        return len(self._queue)


class Waker:
    """A worker's wake-up: ``wake()`` runs ``step`` once this moment's events are all in (a
    worker drains its socket, then steps), unless ``busy()`` says a step is under way (its end
    steps again)."""

    def __init__(self, loop: EventLoop, step: Callable[[], None], busy: Callable[[], bool]):
        self._loop = loop
        self._step = step
        self._busy = busy
        self._pending = False

    def wake(self) -> None:
        if not self._busy() and not self._pending:
            self._pending = True
            self._loop.after(0.0, self._kick)

    def _kick(self) -> None:
        self._pending = False
        if not self._busy():
            self._step()
