"""Requests held for a worker: a model whose pools were whole once has, for now, no worker
that can decode it (its only decode worker restarting, a colocated pool's workers all gone).
A request for it waits here, up to ``hold_s`` (``--hold-timeout``), for a worker to register
again, rather than failing at once; then the coordinator places it as if it had just come, or
it fails with a 503 saying how long it waited. The holds are bounded (``max_held``: past it, a
503 at once), and an ``Abort`` takes its request out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.protocol import messages as m

DEFAULT_HOLD_S = 10.0  # a worker's restart under `pdserve serve` (load, warm-up) fits in it
MAX_HELD = 4096


@dataclass(frozen=True)
class Held:
    request: m.Generate
    since: float


class Holds:
    """Owns the held requests, oldest first, by request id (a resumed choice is held by its
    request id and choice)."""

    def __init__(self, hold_s: float, max_held: int = MAX_HELD) -> None:
        if hold_s < 0:
            raise ValueError(f"the hold timeout must be >= 0 s (0: no hold), got {hold_s}")
        self.hold_s = hold_s
        self.max_held = max_held
        self._held: OrderedDict[tuple[str, int | None], Held] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, req: m.Generate, now: float) -> bool:
        """Hold ``req``; False when holds are off or full (the caller refuses it)."""
        if self.hold_s <= 0 or len(self._held) >= self.max_held:
            return False
        self._held[(req.request_id, req.resume_choice)] = Held(req, now)
        return True

    def take(self, can_run: Callable[[str], bool], now: float) -> tuple[list[Held], list[Held]]:
        """The held requests whose model can take them now (out of the holds, in arrival
        order), and those past ``hold_s`` that still cannot (out too: the caller fails them)."""
        runnable: list[Held] = []
        expired: list[Held] = []
        for key, held in list(self._held.items()):
            if can_run(held.request.model):
                runnable.append(held)
            elif now - held.since >= self.hold_s:
                expired.append(held)
            else:
                continue
            del self._held[key]
        return runnable, expired

    def drop(self, request_id: str) -> list[m.Generate]:
        """Take every held request of ``request_id`` out (its gateway aborted it)."""
        keys = [k for k in self._held if k[0] == request_id]
        return [self._held.pop(k).request for k in keys]
