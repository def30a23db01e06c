"""Two gateways (real HTTP apps, the fake backend behind each) share one tenant's budget through
a real ``redis-server``: the sum they admit stays within the limit; with Redis killed they keep
serving on their share of it, the ``/metrics`` gauge says so, and they go back when it
returns."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.app import create_app
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.tenancy.args import check_reachable, limiter_store
from pdserve.gateway.tenancy.core import Tenancy
from pdserve.gateway.tenancy.limiter_store import Limits, MemoryStore
from pdserve.gateway.tenancy.ratelimit import RateLimiter
from pdserve.gateway.tenancy.redis_store import FallbackStore, RedisStore
from pdserve.gateway.tenancy.tenants import TenantsFile, hash_key
from tests.gateway_util import MODELS, FakeBackend, Script, running_server
from tests.test_ratelimit_redis import RedisServer, started

RPM = 12


def gauge(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(
        float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("pdserve_rate_limit_store_degraded ")
    )


@contextlib.contextmanager
def gateways(tok: Tokenizer, tmp_path: Path, redis: RedisServer) -> Iterator[list[str]]:
    path = tmp_path / "tenants.toml"
    text = f'[tenants.acme]\nrequests_per_minute = {RPM}\nkeys = ["{hash_key("sk-acme")}"]\n'
    path.write_text(text, encoding="utf-8")
    eos = tok.eos_token_ids[0]
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(2):
            primary = RedisStore(redis.url, timeout_s=0.5)
            store = FallbackStore(primary, MemoryStore(), share=0.5, retry_s=0.5)
            tenancy = Tenancy(TenantsFile(path), limiter=RateLimiter(store))
            backend = FakeBackend(MODELS, Script([[*tok.encode("ok", False), eos]]))
            app = create_app(backend, {"tiny": tok}, config=GatewayConfig(), tenancy=tenancy)
            urls.append(stack.enter_context(running_server(app)))
        yield urls


def flood(urls: list[str], per_gateway: int) -> list[int]:
    """``per_gateway`` requests to each gateway at once; their statuses."""
    statuses: list[int] = []
    lock = threading.Lock()

    def one(url: str) -> None:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        headers = {"Authorization": "Bearer sk-acme"}
        status = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        with lock:
            statuses.append(status.status_code)

    threads = [threading.Thread(target=one, args=(u,)) for u in urls for _ in range(per_gateway)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


def test_two_gateways_one_budget_and_redis_killed(tok: Tokenizer, tmp_path: Path) -> None:
    run = started(tmp_path)
    redis = next(run)
    try:
        with gateways(tok, tmp_path, redis) as urls:
            statuses = flood(urls, 10)  # 20 at once against 12 a minute between them
            # a bucket refills 12/min: at most one more comes back while the flood runs
            assert RPM <= statuses.count(200) <= RPM + 1, statuses
            assert statuses.count(429) == 20 - statuses.count(200)
            assert [gauge(u) for u in urls] == [0, 0]
            redis.stop()
            # each gateway now serves half the limit from memory: 6 a minute each
            statuses = flood(urls, 8)
            assert 2 * RPM // 2 <= statuses.count(200) <= 2 * (RPM // 2 + 1), statuses
            assert [gauge(u) for u in urls] == [1, 1]
            redis.start()
            time.sleep(0.6)  # past retry_s: the next call tries Redis again
            for url in urls:
                flood([url], 1)
            assert [gauge(u) for u in urls] == [0, 0]
    finally:
        run.close()


def test_a_redis_password_from_a_file(tmp_path: Path) -> None:
    run = started(tmp_path, password="s3cret pass")
    redis = next(run)
    try:
        (tmp_path / "pw").write_text("s3cret pass\n", encoding="utf-8")
        store = limiter_store(redis.url, 1, str(tmp_path / "pw"))
        limits = Limits(requests_per_minute=2)
        assert store.take("t", limits, 0, "r").refused is None
        assert isinstance(store, FallbackStore) and not store.degraded  # Redis took it
        (tmp_path / "bad").write_text("wrong\n", encoding="utf-8")
        with pytest.raises(ValueError, match="Redis refused the password"):
            check_reachable(limiter_store(redis.url, 1, str(tmp_path / "bad")))
        check_reachable(store)  # the right one: no error
        with pytest.raises(ValueError, match="needs a redis:// store"):
            limiter_store("memory", 1, str(tmp_path / "pw"))
        (tmp_path / "empty").write_text("\n", encoding="utf-8")
        with pytest.raises(ValueError, match="holds no password"):
            limiter_store(redis.url, 1, str(tmp_path / "empty"))
    finally:
        run.close()
