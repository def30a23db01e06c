"""Tenancy at the gateway: who a request is for, what its tenant's limits let in, what it used.

    Authorization: Bearer KEY --authenticate--> Tenant (401 if no tenant holds KEY)
    prepared job --admit--> Hold: 1 request, prompt + n * max_tokens tokens, one slot (or 429)
    stream --tokens--> charged as it runs      end --finish--> given back, metered, once

``Tenancy`` owns the tenants in force (``--tenants FILE``, reloaded on SIGHUP, beside the
``--api-key`` keys as the one unlimited tenant ``default``), the limiter over its store
(memory, or Redis through ``FallbackStore``), the usage meter (``--usage-db``) and the
``pdserve_tenant_*`` metrics. With neither keys nor a tenants file the API is open and every
request is the unlimited ``default`` tenant's: metered, never limited.

Every answer to a limited tenant's generation request carries the ``x-ratelimit-*`` headers
(``RateLimitHeaders``): the standing its admission saw, or, for a request refused before it
(a 400), the standing now. Store calls run in a worker thread unless the store is in memory, so
a slow or unreachable Redis never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeVar

from pdserve.gateway.errors import OpenAIError, invalid_api_key
from pdserve.gateway.metrics import Outcome
from pdserve.gateway.observe.prometheus import Counter, Gauge, Registry
from pdserve.gateway.tenancy.limiter_store import Limits, MemoryStore
from pdserve.gateway.tenancy.meter import UsageMeter
from pdserve.gateway.tenancy.ratelimit import (
    Decision,
    RateLimiter,
    Reservation,
    error_body,
    headers,
)
from pdserve.gateway.tenancy.ratelimit import retry_after as retry_after_of
from pdserve.gateway.tenancy.redis_store import FallbackStore
from pdserve.gateway.tenancy.tenants import UNLIMITED, Tenant, Tenants, TenantsError, TenantsFile
from pdserve.gateway.tenancy.usage import UsageRecord, UsageTotals

log = logging.getLogger(__name__)

T = TypeVar("T")
TENANT = "tenant"  # request.state: the Tenant a request was admitted as
RATELIMIT_HEADERS = "ratelimit_headers"  # request.state: x-ratelimit-* for its answer
OPEN = Tenant(name=UNLIMITED)  # every request's tenant when no key is asked for


def limits_of(tenant: Tenant) -> Limits:
    return Limits(tenant.requests_per_minute, tenant.tokens_per_minute, tenant.max_concurrent)


def is_limited(tenant: Tenant) -> bool:
    return limits_of(tenant) != Limits()


@dataclasses.dataclass
class Hold:
    """One admitted request's claim on its tenant: the reservation (None for a tenant without
    limits) and the headers its answer carries; ended once, by ``Tenancy.finish``."""

    tenant: Tenant
    model: str
    request_id: str
    reservation: Reservation | None
    headers: dict[str, str]
    ended: bool = False


class TenantMetrics:
    """``pdserve_tenant_*``: requests by outcome and tokens by kind per tenant and model, the
    rate limiter's refusals, and whether it serves local limits (Redis unreachable)."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        by = ["tenant", "model"]
        self.requests = r.add(
            Counter("pdserve_tenant_requests_total", "Requests by outcome.", [*by, "outcome"])
        )
        self.tokens = r.add(
            Counter(
                "pdserve_tenant_tokens_total",
                "Tokens by kind (prompt, completion, cached: prompt tokens from the cache).",
                [*by, "kind"],
            )
        )
        self.limited = r.add(
            Counter(
                "pdserve_rate_limited_total",
                "Requests refused by a rate limit, by the limit.",
                ["tenant", "limit"],
            )
        )
        self.degraded = r.add(
            Gauge(
                "pdserve_rate_limit_store_degraded",
                "1 while the shared store (Redis) is unreachable and local limits apply.",
            )
        )

    def set(self, totals: list[UsageTotals], degraded: bool) -> None:
        """Replace the usage families with ``totals`` (the meter's, since start)."""
        self.requests.clear()
        self.tokens.clear()
        for t in totals:
            labels = {"tenant": t.tenant, "model": t.model}
            for outcome, count in t.requests.items():
                if count:
                    self.requests.inc(count, outcome=outcome.value, **labels)
            for kind in ("prompt", "completion", "cached"):
                self.tokens.inc(getattr(t, f"{kind}_tokens"), kind=kind, **labels)
        self.degraded.set(1.0 if degraded else 0.0)


class Tenancy:
    """The tenants in force, their limiter and their meter (module docstring)."""

    def __init__(
        self,
        tenants_file: TenantsFile | None = None,
        api_keys: tuple[str, ...] = (),
        limiter: RateLimiter | None = None,
        meter: UsageMeter | None = None,
    ) -> None:
        """``meter``: where usage is recorded (``--usage-db``); default: live totals only."""
        self.tenants_file = tenants_file
        self.api_keys = api_keys
        self.limiter = limiter or RateLimiter(MemoryStore())
        self.meter = meter or UsageMeter(None)  # live totals only, without --usage-db
        self.metrics = TenantMetrics()
        self.tenants = self._merged(tenants_file.tenants if tenants_file else None)

    @property
    def open(self) -> bool:
        """No key is asked for: every request is ``OPEN``'s."""
        return self.tenants is None

    def _merged(self, from_file: Tenants | None) -> Tenants | None:
        if from_file is None and not self.api_keys:
            return None
        extra = list(Tenants.unlimited(self.api_keys)) if self.api_keys else []
        if from_file is not None and extra and UNLIMITED in from_file:
            raise TenantsError(
                self.tenants_file.path if self.tenants_file else "",
                f"tenant {UNLIMITED!r} is the --api-key keys' tenant: rename it",
            )
        return Tenants([*(from_file or ()), *extra])

    def reload(self) -> TenantsError | None:
        """SIGHUP: read the tenants file again; a refused file leaves the tenants in force."""
        if self.tenants_file is None:
            log.info("SIGHUP: no tenants file to reload")
            return None
        error = self.tenants_file.reload()
        if error is None:
            try:
                self.tenants = self._merged(self.tenants_file.tenants)
            except TenantsError as e:
                log.error("tenants file refused, the previous one stays in force: %s", e)
                return e
        return error

    def authenticate(self, token: bytes | None) -> Tenant | OpenAIError:
        """The tenant holding the bearer ``token`` (None: no Authorization header), or 401."""
        tenants = self.tenants
        if tenants is None:
            return OPEN
        tenant = tenants.lookup(token) if token else None
        return tenant if tenant is not None else invalid_api_key(given=token is not None)

    async def _store(self, call: Callable[..., T], *args: object) -> T:
        if isinstance(self.limiter.store, MemoryStore):
            return call(*args)
        return await asyncio.to_thread(call, *args)

    async def admit(
        self, tenant: Tenant, model: str, request_id: str, prompt_tokens: int, max_tokens: int
    ) -> Hold:
        """Take what the request may use, or raise the 429 (headers, ``Retry-After`` unless no
        wait helps) after metering the refusal."""
        if not is_limited(tenant):
            return Hold(tenant, model, request_id, None, {})
        limits = limits_of(tenant)
        decision: Decision = await self._store(
            self.limiter.admit, tenant.name, limits, prompt_tokens, max_tokens
        )
        found = headers(decision.usage)
        if decision.reservation is not None:
            return Hold(tenant, model, request_id, decision.reservation, found)
        assert decision.refused is not None
        self.metrics.limited.inc(tenant=tenant.name, limit=decision.refused.value)
        self._meter(Hold(tenant, model, request_id, None, found), Outcome.REJECTED, 0, 0, 0)
        raise rate_limited(decision, found)

    def tokens(self, hold: Hold, completion_tokens: int) -> None:
        """A stream's progress: what it has generated so far, all choices together."""
        if hold.reservation is not None:
            self.limiter.charge(hold.reservation, completion_tokens)

    async def finish(
        self, hold: Hold, outcome: Outcome, prompt: int, completion: int, cached: int
    ) -> None:
        """Give back what the request did not use and meter it; once (later calls do
        nothing). The counts are its response's ``usage``: all zeros when the cluster refused
        it, which gives its prompt tokens back too."""
        if hold.ended:
            return
        hold.ended = True
        self._meter(hold, outcome, prompt, completion, cached)
        if hold.reservation is not None:
            try:
                ran = prompt > 0
                await self._store(self.limiter.finish, hold.reservation, completion, ran)
            except Exception:  # the store's lease gives the slot back in the end
                log.exception("request %s: rate limit give-back failed", hold.request_id)

    async def standing(self, tenant: Tenant) -> dict[str, str]:
        """The tenant's ``x-ratelimit-*`` headers now (for an answer before admission)."""
        if not is_limited(tenant):
            return {}
        usage = await self._store(self.limiter.usage, tenant.name, limits_of(tenant))
        return headers(usage)

    def _meter(
        self, hold: Hold, outcome: Outcome, prompt: int, completion: int, cached: int
    ) -> None:
        record = UsageRecord(
            tenant=hold.tenant.name,
            model=hold.model,
            request_id=hold.request_id,
            outcome=outcome,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            finished_at=datetime.now(UTC),
        )
        self.meter.record(record)

    @property
    def degraded(self) -> bool:
        """Whether the shared store is unreachable and local limits apply."""
        store = self.limiter.store
        return isinstance(store, FallbackStore) and store.degraded

    def metrics_text(self) -> str:
        self.metrics.set(self.meter.live_totals(), self.degraded)
        return self.metrics.registry.render()

    def close(self) -> None:
        """Write every queued usage record (a clean shutdown loses none)."""
        self.meter.close()


def rate_limited(decision: Decision, found: dict[str, str]) -> OpenAIError:
    """The 429 for a refused ``decision``: OpenAI's body, the headers, and ``Retry-After``
    (none for a request larger than the bucket: no wait lets it in)."""
    detail = error_body(decision)["error"]
    error = OpenAIError(
        429, detail["message"], type=detail["type"], code=detail["code"], headers=found
    )
    wait = retry_after_of(decision)
    if wait is None:
        error.headers.pop("Retry-After", None)
    else:
        error.headers["Retry-After"] = wait
    return error
