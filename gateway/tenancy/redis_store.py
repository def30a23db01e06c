"""The rate limiter's counters in Redis, shared by several gateways (``RedisStore``), and the
store a gateway runs on (``FallbackStore``): Redis while it answers, its own fair share of
the limits in memory while it does not.

Per tenant, two keys under one hash tag (``{tenant}``, so a cluster keeps them on one node)::

    <prefix>:{t}:bucket   hash: requests, tokens (units), updated_ms    expires when full
    <prefix>:{t}:flight   sorted set: reservation id -> its lease's end  expires with the last

Each call is one EVALSHA of one Lua script: refill from the server's TIME, drop lapsed leases,
act, write back. The arithmetic is ``limiter_store``'s, integers throughout (Lua's numbers
are doubles: exact below 2**53, which ``_MAX_LIMIT`` keeps every level under).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from pdserve.gateway.tenancy.limiter_store import (
    CONCURRENCY_RETRY_MS,
    UNITS,
    Levels,
    LimitKind,
    Limits,
    MemoryStore,
    Taken,
)

log = logging.getLogger(__name__)

_MAX_LIMIT = 2**53 // (4 * UNITS)  # room for a level, a debt and a give-back below 2**53
_MAX_URL = 300
_URL = re.compile(
    r"redis://(?P<host>[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):(?P<port>[0-9]{1,5})"
    r"(?:/(?P<db>[0-9]{1,4}))?"
)
_REFUSED = {1: LimitKind.REQUESTS, 2: LimitKind.TOKENS, 3: LimitKind.CONCURRENCY}

# ARGV[1..3]: rpm, tpm, max_concurrent ('' = unlimited); ARGV[4]: now in ms ('' = server TIME)
_PRELUDE = """
local bucket, flight, units = KEYS[1], KEYS[2], @UNITS@
local rpm, tpm, most = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = tonumber(ARGV[4])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local s = redis.call('HMGET', bucket, 'requests', 'tokens', 'updated_ms')
local req, tok, upd = tonumber(s[1]), tonumber(s[2]), tonumber(s[3])
if not upd then req, tok, upd = (rpm or 0) * units, (tpm or 0) * units, now end
local elapsed = math.max(0, now - upd)  -- a clock going back refills nothing
if rpm then req = math.min(rpm * units, req + elapsed * rpm) end
if tpm then tok = math.min(tpm * units, tok + elapsed * tpm) end
upd = math.max(upd, now)
redis.call('ZREMRANGEBYSCORE', flight, '-inf', now)  -- leases of gateways gone quiet
local function save()
  redis.call('HSET', bucket, 'requests', string.format('%d', req),
    'tokens', string.format('%d', tok), 'updated_ms', string.format('%d', upd))
  local idle = 60000  -- once full, a lost hash reads back the same: it may go
  if rpm then idle = math.max(idle, math.ceil((rpm * units - req) / rpm)) end
  if tpm then idle = math.max(idle, math.ceil((tpm * units - tok) / tpm)) end
  redis.call('PEXPIRE', bucket, idle)
end
local function wait(level, need, limit)  -- ceil((need - level) / limit), exact below 2**53
  local d = need - level
  if d <= 0 then return 0 end
  local q = math.floor(d / limit)
  if q * limit < d then q = q + 1 end
  return q
end
""".replace("@UNITS@", str(UNITS))

# ARGV[5..8]: tokens, rid, lease ms, concurrency retry ms
# -> {refused 0-3, wait_ms, req, tok, in flight}
_TAKE = (
    _PRELUDE
    + """
local tokens, rid, lease = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local flying = redis.call('ZCARD', flight)
local refused, ms = 0, 0
if most and flying >= most then
  refused, ms = 3, tonumber(ARGV[8])
else
  local wr = rpm and wait(req, units, rpm) or 0
  local wt = tpm and wait(tok, tokens * units, tpm) or 0
  if wr > 0 or wt > 0 then  -- both must pass: the longer wait binds
    if wr >= wt then refused, ms = 1, wr else refused, ms = 2, wt end
  else
    if rpm then req = req - units end
    if tpm then tok = tok - tokens * units end
    redis.call('ZADD', flight, now + lease, rid)
    redis.call('PEXPIRE', flight, lease)
    flying = flying + 1
  end
end
save()
return {refused, ms, req, tok, flying}
"""
)

# ARGV[5]: tokens back, ARGV[6]: rid -> {settled 0/1, req, tok, in flight}
_SETTLE = (
    _PRELUDE
    + """
local found = redis.call('ZREM', flight, ARGV[6])
if found == 1 and tpm then tok = math.min(tpm * units, tok + tonumber(ARGV[5]) * units) end
save()
return {found, req, tok, redis.call('ZCARD', flight)}
"""
)

_LEVELS = _PRELUDE + "\nsave()\nreturn {req, tok, redis.call('ZCARD', flight)}\n"


@dataclass(frozen=True)
class RedisAddress:
    host: str
    port: int
    db: int


def parse_url(url: str) -> RedisAddress:
    """``redis://HOST:PORT[/DB]``, nothing else: no credentials, no query, bounded lengths."""
    if not isinstance(url, str) or len(url) > _MAX_URL:
        raise ValueError(f"--rate-limit-store: a redis:// URL of at most {_MAX_URL} characters")
    match = _URL.fullmatch(url)
    if match is None:
        raise ValueError(
            f"--rate-limit-store must look like redis://HOST:PORT/DB (no user or password), "
            f"got {url!r}"
        )
    port, db = int(match["port"]), int(match["db"] or 0)
    if not 1 <= port <= 65535:
        raise ValueError(f"--rate-limit-store: port {port} is not in 1..65535")
    return RedisAddress(match["host"].strip("[]"), port, db)


def _arg(limit: int | None) -> str:
    if limit is not None and limit > _MAX_LIMIT:
        raise ValueError(f"a limit of {limit} is above the Redis store's {_MAX_LIMIT}")
    return "" if limit is None else str(limit)


class RedisStore:
    """``LimiterStore`` over Redis, one round trip a call. ``clock`` (seconds) replaces the
    server's TIME, for tests only: gateways must share the server's clock. A reservation's
    slot lapses ``lease_s`` after it was taken, so a dead gateway's slots come back."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "pdserve:rl",
        lease_s: float = 900.0,
        timeout_s: float = 1.0,
        clock: Callable[[], float] | None = None,
        password: str | None = None,
    ) -> None:
        """``password``: Redis' ``requirepass`` (``--rate-limit-store-password-file``), never
        part of the URL a command line shows."""
        address = parse_url(url)
        if not lease_s >= 0.001:
            raise ValueError(f"lease_s must be at least 1 ms, got {lease_s!r}")
        self._prefix, self._lease_ms, self._clock = prefix, math.ceil(lease_s * 1000), clock
        self.client = redis.Redis(
            host=address.host,
            port=address.port,
            db=address.db,
            password=password,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # one retry, no backoff: reconnects a pooled socket after a restart, fails fast
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 1),
        )
        self._take = self.client.register_script(_TAKE)
        self._settle = self.client.register_script(_SETTLE)
        self._levels = self.client.register_script(_LEVELS)

    def _run(self, script: Any, tenant: str, limits: Limits, *extra: str | int) -> list[int]:
        keys = [f"{self._prefix}:{{{tenant}}}:bucket", f"{self._prefix}:{{{tenant}}}:flight"]
        now = "" if self._clock is None else str(round(self._clock() * 1000))
        limit_args = (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent)
        args = [*(_arg(limit) for limit in limit_args), now, *extra]
        return [int(value) for value in script(keys=keys, args=args)]

    def take(self, tenant: str, limits: Limits, tokens: int, rid: str) -> Taken:
        tpm = limits.tokens_per_minute
        if tpm is not None and tokens > tpm:
            raise ValueError(f"{tokens} tokens can never fit a bucket of {tpm}")
        refused, ms, req, tok, flying = self._run(
            self._take, tenant, limits, tokens, rid, self._lease_ms, CONCURRENCY_RETRY_MS
        )
        return Taken(_REFUSED.get(refused), ms, Levels(req, tok, flying))

    def settle(self, tenant: str, limits: Limits, tokens_back: int, rid: str) -> Levels | None:
        found, req, tok, flying = self._run(self._settle, tenant, limits, tokens_back, rid)
        return Levels(req, tok, flying) if found else None

    def levels(self, tenant: str, limits: Limits) -> Levels:
        return Levels(*self._run(self._levels, tenant, limits))


def _scaled(limit: int | None, share: float) -> int | None:
    return None if limit is None else max(1, math.floor(limit * share))


class FallbackStore:
    """Redis while it answers; while it does not, ``local`` with each limit scaled to
    ``share`` (1 / the number of gateways: together they keep about the whole limit). Says
    so once each way in the log and in ``degraded`` (a /metrics gauge); tries Redis again at
    most every ``retry_s``. A reservation settles where it was taken: one taken in Redis and
    ended while Redis is away comes back there when its lease lapses."""

    def __init__(
        self,
        primary: RedisStore,
        local: MemoryStore,
        share: float,
        *,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.primary, self.local, self.share = primary, local, share
        self._retry_s, self._clock = retry_s, clock
        self._lock = threading.Lock()
        self._retry_at = 0.0  # while degraded: when Redis may be tried again
        self.degraded = False

    def _use_primary(self) -> bool:
        with self._lock:
            if not self.degraded:
                return True
            now = self._clock()
            if now < self._retry_at:
                return False
            self._retry_at = now + self._retry_s  # one caller tries; the others stay local
            return True

    def _went(self, degraded: bool, error: Exception | None = None) -> None:
        with self._lock:
            if degraded == self.degraded:
                return
            self.degraded = degraded
            if degraded:
                self._retry_at = self._clock() + self._retry_s
                log.warning(
                    "rate limits: Redis unreachable (%s); serving local limits at %.3g of each",
                    error,
                    self.share,
                )
            else:
                log.warning("rate limits: Redis is back; serving the shared limits again")

    def _call(self, on_primary: Callable[[], Any], on_local: Callable[[], Any]) -> Any:
        if self._use_primary():
            try:
                result = on_primary()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as error:
                self._went(True, error)
            else:
                self._went(False)
                return result
        return on_local()

    def _local_limits(self, limits: Limits) -> Limits:
        return Limits(
            requests_per_minute=_scaled(limits.requests_per_minute, self.share),
            tokens_per_minute=_scaled(limits.tokens_per_minute, self.share),
            max_concurrent=_scaled(limits.max_concurrent, self.share),
        )

    def _take_local(self, tenant: str, limits: Limits, tokens: int, rid: str) -> Taken:
        local = self._local_limits(limits)
        if local.tokens_per_minute is not None and tokens > local.tokens_per_minute:
            # fits the shared limit, not this gateway's share: refused until Redis is back
            levels = self.local.levels(tenant, local)
            return Taken(LimitKind.TOKENS, math.ceil(self._retry_s * 1000), levels)
        return self.local.take(tenant, local, tokens, rid)

    def take(self, tenant: str, limits: Limits, tokens: int, rid: str) -> Taken:
        taken: Taken = self._call(
            lambda: self.primary.take(tenant, limits, tokens, rid),
            lambda: self._take_local(tenant, limits, tokens, rid),
        )
        return taken

    def settle(self, tenant: str, limits: Limits, tokens_back: int, rid: str) -> Levels | None:
        settled = self.local.settle(tenant, self._local_limits(limits), tokens_back, rid)
        if settled is not None:  # taken while degraded
            return settled
        result: Levels | None = self._call(
            lambda: self.primary.settle(tenant, limits, tokens_back, rid), lambda: None
        )
        return result

    def levels(self, tenant: str, limits: Limits) -> Levels:
        levels: Levels = self._call(
            lambda: self.primary.levels(tenant, limits),
            lambda: self.local.levels(tenant, self._local_limits(limits)),
        )
        return levels
