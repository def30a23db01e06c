"""The rate limiter's counters and their atomic updates: the ``LimiterStore`` contract, the
bucket arithmetic, and ``MemoryStore`` (one gateway). ``ratelimit.py`` holds the policy.

Per tenant: a token bucket for requests and one for tokens, one timestamp, the ids in flight.
Levels are integers in units of 1/60,000 of a request or token, time is whole milliseconds, so
a limit of L per minute (capacity L) refills exactly L units a ms::

    level(now) = min(L * UNITS, level + (now_ms - updated_ms) * L)
    wait until level >= need:  ceil((need - level) / L) ms        (0 when it holds)

No float enters a level, so counts and waits are exact at any edge. A kind with no limit is
not counted. Each store call is one read-modify-write of one tenant: in Redis, one Lua script
over one hash (``requests``, ``tokens``, ``updated_ms``) and one sorted set of reservation
ids scored by their lease's end, with the server's TIME as the clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

UNITS = 60_000  # bucket units per token or request: L per minute refills L units per ms
CONCURRENCY_RETRY_MS = 1_000  # a slot frees when some request ends: no time to compute


class LimitKind(Enum):
    """Which limit refused a request."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"


@dataclass(frozen=True)
class Limits:
    """One tenant's limits. None is unlimited; 0 is refused (it would admit nothing)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


@dataclass(frozen=True)
class Levels:
    """A store's counters for one tenant: bucket levels in units, requests in flight."""

    requests: int
    tokens: int
    in_flight: int


@dataclass(frozen=True)
class Taken:
    """A store's answer to ``take``: the binding limit and the ms until it would pass, or
    ``refused=None`` when the request, the tokens and the slot were taken."""

    refused: LimitKind | None
    wait_ms: int
    levels: Levels


class LimiterStore(Protocol):
    """Where the counters live. Each call is atomic as a unit and reads the store's own clock
    (Redis: the server's, so gateways with skewed clocks agree; a dead gateway's ids lapse
    with their lease). ``rid`` names a reservation: settling it twice settles it once."""

    def take(self, tenant: str, limits: Limits, tokens: int, rid: str) -> Taken:
        """Refill; if a slot, 1 request and ``tokens`` are there, take them for ``rid``."""
        ...

    def settle(self, tenant: str, limits: Limits, tokens_back: int, rid: str) -> Levels | None:
        """Refill; if ``rid`` is in flight, release it and add ``tokens_back`` (may be < 0);
        None when it was not (settled already)."""
        ...

    def levels(self, tenant: str, limits: Limits) -> Levels:
        """Refill and read, taking nothing."""
        ...


def refill(level: int, elapsed_ms: int, limit: int) -> int:
    """A bucket's level after ``elapsed_ms``: ``limit`` units a ms, capped at capacity."""
    return min(limit * UNITS, level + elapsed_ms * limit)


def wait_ms(level: int, need: int, limit: int) -> int:
    """Whole ms until a bucket at ``level`` holds ``need`` units (0 when it does now)."""
    return max(0, -(-(need - level) // limit))


@dataclass
class _Tenant:
    requests: int  # units
    tokens: int  # units
    updated_ms: int
    in_flight: set[str] = field(default_factory=set)

    def levels(self) -> Levels:
        return Levels(self.requests, self.tokens, len(self.in_flight))


class MemoryStore:
    """The counters of one gateway, in memory, one lock around each call. ``clock`` gives
    seconds (monotonic by default; tests pass a fake). One entry per tenant ever seen: tenants
    come from the key file, so the table is bounded by it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tenants: dict[str, _Tenant] = {}

    def _refilled(self, tenant: str, limits: Limits) -> _Tenant:
        now_ms = round(self._clock() * 1000)
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        state = self._tenants.get(tenant)
        if state is None:
            state = _Tenant((rpm or 0) * UNITS, (tpm or 0) * UNITS, now_ms)
            self._tenants[tenant] = state
        elapsed = max(0, now_ms - state.updated_ms)  # a clock going back refills nothing
        if rpm is not None:
            state.requests = refill(state.requests, elapsed, rpm)
        if tpm is not None:
            state.tokens = refill(state.tokens, elapsed, tpm)
        state.updated_ms = max(state.updated_ms, now_ms)
        return state

    def take(self, tenant: str, limits: Limits, tokens: int, rid: str) -> Taken:
        rpm, tpm, most = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
        if tpm is not None and tokens > tpm:
            raise ValueError(f"{tokens} tokens can never fit a bucket of {tpm}")
        with self._lock:
            state = self._refilled(tenant, limits)
            if most is not None and len(state.in_flight) >= most:
                return Taken(LimitKind.CONCURRENCY, CONCURRENCY_RETRY_MS, state.levels())
            wait_r = wait_ms(state.requests, UNITS, rpm) if rpm is not None else 0
            wait_t = wait_ms(state.tokens, tokens * UNITS, tpm) if tpm is not None else 0
            if wait_r or wait_t:  # both must pass: the longer wait binds
                binding = LimitKind.REQUESTS if wait_r >= wait_t else LimitKind.TOKENS
                return Taken(binding, max(wait_r, wait_t), state.levels())
            if rpm is not None:
                state.requests -= UNITS
            if tpm is not None:
                state.tokens -= tokens * UNITS
            state.in_flight.add(rid)
            return Taken(None, 0, state.levels())

    def settle(self, tenant: str, limits: Limits, tokens_back: int, rid: str) -> Levels | None:
        with self._lock:
            state = self._refilled(tenant, limits)
            if rid not in state.in_flight:
                return None
            state.in_flight.discard(rid)
            if limits.tokens_per_minute is not None:
                state.tokens = min(
                    limits.tokens_per_minute * UNITS, state.tokens + tokens_back * UNITS
                )
            return state.levels()

    def levels(self, tenant: str, limits: Limits) -> Levels:
        with self._lock:
            return self._refilled(tenant, limits).levels()
