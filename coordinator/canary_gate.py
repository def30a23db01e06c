"""The release gate: a canary version whose error rate or TTFT p99 over a window is worse than
its stable version's by more than a margin is rolled back (``Rollouts`` acts on the verdict).

Inputs are what every gateway measured (``LatencySamples`` in each ``GatewayHello``): per
served model, the requests that ended and how many failed, and each one's time to first
token. A version is compared only once it has ``min_requests`` in the window, so one slow
request never decides. A canary that cannot start at all (its workers never register) fails
every request it is given: its error rate decides.

    heard(samples, now) ──▶ Window per version (bounded) ──▶ verdict(stable, canary, now)
                                                               └─▶ why to roll back, or None
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from pdserve.protocol.planning import LatencySamples

MAX_WINDOW_SAMPLES = 8192  # TTFT samples kept per version (the oldest go first)


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    """``error_margin``: how far (a fraction of requests) a canary's error rate may exceed the
    stable's; ``ttft_margin``: how far (a fraction of the stable's) its TTFT p99 may."""

    window_s: float = 60.0
    error_margin: float = 0.05
    ttft_margin: float = 0.5
    min_requests: int = 20

    def __post_init__(self) -> None:
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError(f"the canary gate's window must be > 0 s, got {self.window_s}")
        if not 0 <= self.error_margin <= 1:
            raise ValueError(f"the error-rate margin must be 0 to 1, got {self.error_margin}")
        if not (math.isfinite(self.ttft_margin) and self.ttft_margin >= 0):
            raise ValueError(f"the TTFT margin must be >= 0, got {self.ttft_margin}")
        if self.min_requests < 1:
            raise ValueError(f"the minimum sample count must be >= 1, got {self.min_requests}")


@dataclass(frozen=True)
class Figures:
    """One version over the window: requests ended, of those failed, its TTFT samples."""

    requests: int
    errors: int
    ttft_s: tuple[float, ...]

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def ttft_p99(self) -> float | None:
        if not self.ttft_s:
            return None
        ordered = sorted(self.ttft_s)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class Window:
    """One version's samples over the last ``window_s`` seconds."""

    def __init__(self) -> None:
        self.counts: deque[tuple[float, int, int]] = deque()  # (when, requests, errors)
        self.ttft: deque[tuple[float, float]] = deque(maxlen=MAX_WINDOW_SAMPLES)

    def add(self, s: LatencySamples, now: float) -> None:
        if s.requests:
            self.counts.append((now, s.requests, s.errors))
        self.ttft.extend((now, t) for t in s.ttft_s)

    def figures(self, now: float, window_s: float) -> Figures:
        since = now - window_s
        while self.counts and self.counts[0][0] < since:
            self.counts.popleft()
        while self.ttft and self.ttft[0][0] < since:
            self.ttft.popleft()
        requests = sum(c[1] for c in self.counts)
        errors = sum(c[2] for c in self.counts)
        return Figures(requests, errors, tuple(t for _, t in self.ttft))


def verdict(stable: Figures, canary: Figures, config: GateConfig) -> str | None:
    """Why the canary must go (its figures beside the stable's), or None. Each comparison
    needs ``min_requests`` of the canary's (and, for TTFT, of the stable's) in the window."""
    n = config.min_requests
    if canary.requests >= n:
        excess = canary.error_rate - stable.error_rate
        if excess > config.error_margin:
            return (
                f"error rate {canary.error_rate:.3f} ({canary.errors} of {canary.requests} "
                f"requests) over the stable's {stable.error_rate:.3f} ({stable.errors} of "
                f"{stable.requests}) by {excess:.3f} > margin {config.error_margin:g}"
            )
    c99, s99 = canary.ttft_p99(), stable.ttft_p99()
    if c99 is None or s99 is None or len(canary.ttft_s) < n or len(stable.ttft_s) < n:
        return None
    if c99 > s99 * (1 + config.ttft_margin):
        return (
            f"TTFT p99 {c99:.3f} s ({len(canary.ttft_s)} requests) over the stable's "
            f"{s99:.3f} s ({len(stable.ttft_s)}) by more than {config.ttft_margin:.0%}"
        )
    return None


class CanaryGate:
    """Owns each watched version's ``Window``; ``check`` gives the verdict on one canary."""

    def __init__(self, config: GateConfig) -> None:
        self.config = config
        self._windows: dict[str, Window] = {}  # served name (NAME@VERSION) -> its window

    def heard(self, samples: list[LatencySamples], now: float, watched: set[str]) -> None:
        """A gateway's samples; only ``watched`` versions' are kept (a bounded set)."""
        for s in samples:
            if s.model in watched:
                self._windows.setdefault(s.model, Window()).add(s, now)
        for gone in set(self._windows) - watched:
            del self._windows[gone]

    def figures(self, served: str, now: float) -> Figures:
        window = self._windows.get(served)
        if window is None:
            return Figures(0, 0, ())
        return window.figures(now, self.config.window_s)

    def check(self, stable: str, canary: str, now: float) -> str | None:
        return verdict(self.figures(stable, now), self.figures(canary, now), self.config)

    def forget(self, served: str) -> None:
        """A version rolled back: what it did before counts no more."""
        self._windows.pop(served, None)
