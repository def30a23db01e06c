"""The gateway's tenancy flags and the ``Tenancy`` they build (``pdserve gateway`` and, passed
through, ``pdserve serve``)::

    --tenants FILE            tenants, their limits and key hashes (SIGHUP reloads it)
    --rate-limit-store URL    memory (one gateway, the default) or redis://HOST:PORT[/DB]
    --rate-limit-gateways N   gateways sharing that Redis: each serves 1/N of every limit
                              while Redis is unreachable
    --rate-limit-store-password-file FILE
                              Redis' password (requirepass), read from a file
    --usage-db FILE           the durable usage record (SQLite; ``pdserve usage`` reads it)
"""

from __future__ import annotations

import argparse
import logging

import redis

from pdserve.gateway.tenancy.core import Tenancy
from pdserve.gateway.tenancy.limiter_store import LimiterStore, MemoryStore
from pdserve.gateway.tenancy.meter import UsageMeter
from pdserve.gateway.tenancy.ratelimit import RateLimiter
from pdserve.gateway.tenancy.redis_store import FallbackStore, RedisStore
from pdserve.gateway.tenancy.tenants import TenantsError, TenantsFile
from pdserve.gateway.tenancy.usage import UsageDbError, UsageStore

log = logging.getLogger(__name__)

MEMORY = "memory"


def add_tenancy_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--tenants",
        metavar="FILE",
        help="a TOML file of tenants: limits, tier, weight and key hashes (pdserve keys add); "
        "SIGHUP reloads it",
    )
    parser.add_argument(
        "--rate-limit-store",
        default=MEMORY,
        metavar="URL",
        help="where rate-limit counters live: memory (this gateway alone) or "
        "redis://HOST:PORT[/DB] (shared by every gateway using it)",
    )
    parser.add_argument(
        "--rate-limit-gateways",
        type=int,
        default=1,
        metavar="N",
        help="gateways sharing --rate-limit-store: while it is unreachable each one serves "
        "1/N of every limit from memory",
    )
    parser.add_argument(
        "--rate-limit-store-password-file",
        metavar="FILE",
        help="a file holding the Redis password (its first line)",
    )
    parser.add_argument(
        "--usage-db",
        metavar="FILE",
        help="record each request's usage per tenant and model in this SQLite file "
        "(read by pdserve usage)",
    )


def read_password(path: str | None) -> str | None:
    """The first line of ``path`` (None: no password); ``ValueError`` for the user."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            password = f.readline(4097).rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the Redis password file {path}: {e}") from e
    if not password or len(password) > 4096:
        raise ValueError(f"the Redis password file {path} holds no password of 1 to 4096 chars")
    return password


def limiter_store(url: str, gateways: int, password_file: str | None = None) -> LimiterStore:
    """The store ``--rate-limit-store`` names; ``ValueError`` for the user otherwise."""
    if gateways < 1:
        raise ValueError(f"--rate-limit-gateways must be >= 1, got {gateways}")
    password = read_password(password_file)
    if url == MEMORY:
        if password is not None:
            raise ValueError("--rate-limit-store-password-file needs a redis:// store")
        return MemoryStore()
    store = RedisStore(url, password=password)
    return FallbackStore(store, MemoryStore(), 1.0 / gateways)


def check_reachable(store: LimiterStore) -> None:
    """At start: a Redis that refuses the password is an error (``ValueError``); one that does
    not answer is logged, and the gateway starts on its local share."""
    if not isinstance(store, FallbackStore):
        return
    try:
        store.primary.client.ping()
    except redis.exceptions.AuthenticationError as e:
        raise ValueError(f"--rate-limit-store: Redis refused the password: {e}") from e
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        log.warning("--rate-limit-store: Redis does not answer (%s); starting on local limits", e)


def tenancy_from_args(args: argparse.Namespace, api_keys: tuple[str, ...]) -> Tenancy:
    """The tenancy the flags describe; ``ValueError`` with a message for the user."""
    try:
        tenants = TenantsFile(args.tenants) if args.tenants else None
        store = limiter_store(
            args.rate_limit_store, args.rate_limit_gateways, args.rate_limit_store_password_file
        )
        check_reachable(store)
        meter = UsageMeter(UsageStore(args.usage_db)) if args.usage_db else None
    except (TenantsError, UsageDbError) as e:
        raise ValueError(str(e)) from e
    except OSError as e:
        raise ValueError(f"cannot open the usage record {args.usage_db}: {e}") from e
    try:
        return Tenancy(tenants, api_keys, RateLimiter(store), meter)
    except TenantsError as e:
        if meter is not None:
            meter.close()
        raise ValueError(str(e)) from e
