"""Per-tenant rate limits as OpenAI applies them: requests per minute, tokens per minute and
requests in flight, with the ``x-ratelimit-*`` headers and the 429 body that report them.

This module owns the policy: what admission takes, what a request's end gives back, and how a
tenant's standing is told. The gateway calls ``RateLimiter.admit`` before it starts a job,
``charge`` as a stream runs and ``finish`` at its end, and puts ``headers(decision.usage)`` on
the answer (a 429 takes ``error_body`` and ``retry_after`` too). The counters live in a
``LimiterStore`` (``limiter_store.py``): in memory for one gateway, in Redis for several.

Algorithm: a token bucket per (tenant, kind), kind = requests or tokens. A limit of L per
minute is a bucket of capacity L refilled continuously at L/60 per second; a new tenant starts
full; remaining = floor(level), reset = the time until the bucket is full again, retry = the
time until it holds the cost. Why a bucket: it is what OpenAI's headers mean (reset is the time
until the limit is back to its initial state; capacity returns continuously, not at a window's
edge); a fixed window lets 2L through across an edge and a sliding log keeps state per request,
where a bucket is two numbers and a timestamp changed by one atomic read-modify-write (one Lua
call in Redis). Integer units make every count exact (``limiter_store``).

A reservation's life: admitted (1 request and prompt_tokens + max_tokens tokens taken, one slot
held) -> charged as it streams -> finished once, completed or aborted, giving back
max_tokens - completion_tokens. Reserving the maximum up front is what keeps many long streams
started at once from overrunning the limit; a request that overran pays the excess (the level
goes below zero: a debt paid by waiting). A request whose prompt + max_tokens exceed the token
limit alone is refused at once, since no wait would let it in. ``Limits``: None is unlimited.
"""

from __future__ import annotations

import math
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.tenancy.limiter_store import (
    UNITS,
    Levels,
    LimiterStore,
    LimitKind,
    Limits,
    wait_ms,
)


@dataclass(frozen=True)
class Bucket:
    """One limited kind's standing: its limit, what is left, ms until it is full again."""

    limit: int
    remaining: int
    reset_ms: int


@dataclass(frozen=True)
class Usage:
    """A tenant's standing, what the ``x-ratelimit-*`` headers say; None where unlimited."""

    requests: Bucket | None
    tokens: Bucket | None
    in_flight: int
    max_concurrent: int | None


def _bucket(level: int, limit: int | None) -> Bucket | None:
    if limit is None:
        return None
    return Bucket(limit, max(0, level // UNITS), wait_ms(level, limit * UNITS, limit))


def usage_of(limits: Limits, levels: Levels) -> Usage:
    return Usage(
        requests=_bucket(levels.requests, limits.requests_per_minute),
        tokens=_bucket(levels.tokens, limits.tokens_per_minute),
        in_flight=levels.in_flight,
        max_concurrent=limits.max_concurrent,
    )


@dataclass
class Reservation:
    """One admitted request's hold: 1 request, prompt + max_tokens tokens, one slot.
    admitted -> charged as it streams -> finished (completed or aborted), once."""

    tenant: str
    limits: Limits
    prompt_tokens: int
    max_tokens: int  # every choice's: n choices of up to m tokens reserve n * m
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    completion_tokens: int = 0  # charged so far
    finished: bool = False


@dataclass(frozen=True)
class Decision:
    """``admit``'s answer: a reservation, or the binding limit and the wait. ``retry_after_s``
    is None for a request too large for the bucket: no wait helps."""

    usage: Usage
    requested_tokens: int
    reservation: Reservation | None = None
    refused: LimitKind | None = None
    retry_after_s: float | None = None

    @property
    def admitted(self) -> bool:
        return self.reservation is not None

    @property
    def too_large(self) -> bool:
        return self.refused is LimitKind.TOKENS and self.retry_after_s is None


def _count(name: str, value: int | None) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


class RateLimiter:
    """Admission, charging and give-back over a store; the lock guards reservations only."""

    def __init__(self, store: LimiterStore) -> None:
        self.store = store
        self._lock = threading.Lock()

    def admit(self, tenant: str, limits: Limits, prompt_tokens: int, max_tokens: int) -> Decision:
        """Take 1 request, prompt_tokens + max_tokens tokens and a slot, or none of them."""
        requested = _count("prompt_tokens", prompt_tokens) + _count("max_tokens", max_tokens)
        tpm = limits.tokens_per_minute
        if tpm is not None and requested > tpm:
            usage = usage_of(limits, self.store.levels(tenant, limits))
            return Decision(usage, requested, refused=LimitKind.TOKENS)
        reservation = Reservation(tenant, limits, prompt_tokens, max_tokens)
        taken = self.store.take(tenant, limits, requested, reservation.rid)
        usage = usage_of(limits, taken.levels)
        if taken.refused is not None:
            return Decision(
                usage, requested, refused=taken.refused, retry_after_s=taken.wait_ms / 1000
            )
        return Decision(usage, requested, reservation=reservation)

    def charge(self, reservation: Reservation, completion_tokens_so_far: int) -> None:
        """Record a stream's progress; the bucket already holds its max_tokens."""
        _count("completion_tokens_so_far", completion_tokens_so_far)
        with self._lock:
            if not reservation.finished:
                reservation.completion_tokens = max(
                    reservation.completion_tokens, completion_tokens_so_far
                )

    def finish(
        self, reservation: Reservation, completion_tokens: int | None = None, ran: bool = True
    ) -> Usage | None:
        """Give back max_tokens - completion_tokens (None: what was charged, for an abort), and
        the prompt's tokens too when it never ran (the cluster refused it), and release the
        slot; None when it was finished already."""
        if completion_tokens is not None:
            _count("completion_tokens", completion_tokens)  # before anything changes
        with self._lock:
            if reservation.finished:
                return None
            reservation.finished = True
            if completion_tokens is not None:
                reservation.completion_tokens = completion_tokens
            back = reservation.max_tokens - reservation.completion_tokens
            back += 0 if ran else reservation.prompt_tokens
        levels = self.store.settle(reservation.tenant, reservation.limits, back, reservation.rid)
        return None if levels is None else usage_of(reservation.limits, levels)

    def usage(self, tenant: str, limits: Limits) -> Usage:
        return usage_of(limits, self.store.levels(tenant, limits))


def format_duration(seconds: float) -> str:
    """OpenAI's reset format (Go's ``time.Duration``), rounded up to the ms: ``0s``, ``250ms``,
    ``1.2s``, ``6m0s``, ``1h2m3s``."""
    ms = -(-round(seconds * 1_000_000) // 1000)  # to µs first: 1.2 * 1000 is not 1200
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def headers(usage: Usage) -> dict[str, str]:
    """The ``x-ratelimit-*`` headers, in OpenAI's order; a kind without a limit has none."""
    kinds = [(k, b) for k, b in (("requests", usage.requests), ("tokens", usage.tokens)) if b]
    out = {f"x-ratelimit-limit-{kind}": str(b.limit) for kind, b in kinds}
    out.update({f"x-ratelimit-remaining-{kind}": str(b.remaining) for kind, b in kinds})
    out.update(
        {f"x-ratelimit-reset-{kind}": format_duration(b.reset_ms / 1000) for kind, b in kinds}
    )
    return out


def retry_after(decision: Decision) -> str | None:
    """``Retry-After``: whole seconds, rounded up, at least 1; None when no wait helps."""
    if decision.retry_after_s is None:
        return None
    return str(max(1, math.ceil(decision.retry_after_s)))


_PER_MIN = {LimitKind.REQUESTS: "requests per min (RPM)", LimitKind.TOKENS: "tokens per min (TPM)"}


def error_body(decision: Decision) -> dict[str, Any]:
    """The OpenAI 429 body for a refusal."""
    usage, refused = decision.usage, decision.refused
    bucket = usage.requests if refused is LimitKind.REQUESTS else usage.tokens
    if refused is LimitKind.CONCURRENCY:
        message = (
            f"Rate limit reached on requests in flight: Limit {usage.max_concurrent}. "
            "Please try again when one of them ends."
        )
    elif refused is None or bucket is None:
        raise ValueError("an admitted request has no error body")
    elif decision.too_large:
        message = (
            f"Request too large on {_PER_MIN[refused]}: Limit {bucket.limit}, "
            f"Requested {decision.requested_tokens}. Reduce the prompt or max_tokens."
        )
    else:
        requested = 1 if refused is LimitKind.REQUESTS else decision.requested_tokens
        message = (
            f"Rate limit reached on {_PER_MIN[refused]}: Limit {bucket.limit}, "
            f"Remaining {bucket.remaining}, Requested {requested}. "
            f"Please try again in {format_duration(decision.retry_after_s or 0.0)}."
        )
    kind = "tokens" if refused is LimitKind.TOKENS else "requests"
    error = {"message": message, "type": kind, "param": None, "code": "rate_limit_exceeded"}
    return {"error": error}
