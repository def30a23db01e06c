"""gateway.tenancy.redis_store against a real ``redis-server`` on a loopback port: the store and
limiter tests of ``test_ratelimit`` again over Redis (a fake clock passed to the scripts),
the server's TIME (levels checked against the times Redis itself stored), two gateways
sharing one budget, lapsing leases, strict URLs, and Redis dying and coming back under a
``FallbackStore``."""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import redis

from pdserve.gateway.tenancy.limiter_store import UNITS, Levels, LimiterStore, MemoryStore, Taken
from pdserve.gateway.tenancy.ratelimit import LimitKind, Limits
from pdserve.gateway.tenancy.redis_store import FallbackStore, RedisAddress, RedisStore, parse_url
from tests.test_ratelimit import (  # noqa: F401  (fixtures and tests, run here over Redis)
    FakeClock,
    limiter,
    often_switching,
    test_a_clock_going_back_refills_nothing,
    test_a_request_larger_than_the_token_limit_is_refused_for_good,
    test_an_abort_gives_back_what_was_not_charged_and_finishing_twice_is_a_no_op,
    test_an_overrun_is_paid_as_a_debt,
    test_concurrency_counts_requests_in_flight,
    test_headers_are_exact_and_in_openais_order,
    test_max_tokens_is_reserved_and_the_unused_part_given_back,
    test_requests_refill_to_the_exact_millisecond,
    test_the_longer_wait_binds_and_is_reported,
    test_the_store_settles_a_reservation_once,
    test_threads_admitting_at_once_take_exactly_the_capacity,
    test_tokens_refill_exactly_at_an_uneven_rate,
    test_unlimited_admits_everything_and_still_counts_in_flight,
    test_what_comes_back_fills_the_bucket_no_higher_than_its_limit,
)

LOGGER = "pdserve.gateway.tenancy.redis_store"


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, no persistence; ``stop`` and ``start`` again keep
    the port (and lose the data, as a restarted cache would)."""

    def __init__(self, directory: Path, password: str | None = None) -> None:
        self.password = password
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.directory, self.url = directory, f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.directory)]
        command += ["--requirepass", self.password] if self.password else []
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, password=self.password)
        for _ in range(100):  # up to about 10 s
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


def started(directory: Path, password: str | None = None) -> Generator[RedisServer, None, None]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is missing: `make venv` installs Debian's package")
    server = RedisServer(directory, password)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from started(tmp_path_factory.mktemp("redis"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(redis_server: RedisServer, clock: FakeClock) -> LimiterStore:
    """Overrides test_ratelimit's: the same tests, over Redis, on the fake clock."""
    redis.Redis(port=redis_server.port).flushdb()
    return RedisStore(redis_server.url, clock=clock)


def stored_ms(client: redis.Redis, tenant: str) -> int:
    return int(client.hget(f"pdserve:rl:{{{tenant}}}:bucket", "updated_ms"))  # type: ignore[arg-type]


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_the_server_clock_refills_by_the_times_redis_stored(redis_server: RedisServer) -> None:
    store, limits = RedisStore(redis_server.url), Limits(tokens_per_minute=1000)
    client = store.client
    client.flushdb()
    before = server_ms(client)
    assert store.take("t", limits, 1000, "a") == Taken(None, 0, Levels(0, 0, 1))
    taken_ms = stored_ms(client, "t")
    assert before <= taken_ms <= server_ms(client)
    level = store.levels("t", limits).tokens  # 1000 units a ms since the take
    assert level == min(1000 * UNITS, (stored_ms(client, "t") - taken_ms) * 1000)
    refused = store.take("t", limits, 1000, "b")
    assert refused.refused is LimitKind.TOKENS
    assert refused.wait_ms == -(-(1000 * UNITS - refused.levels.tokens) // 1000) > 0
    assert refused.levels.tokens >= level  # Redis's clock does not go back here


def test_keys_expire_when_idle(redis_server: RedisServer) -> None:
    store, limits = RedisStore(redis_server.url, lease_s=30), Limits(tokens_per_minute=10)
    store.client.flushdb()
    store.take("t", limits, 10, "a")  # empty: 60 s to refill
    bucket_ttl = store.client.pttl("pdserve:rl:{t}:bucket")
    flight_ttl = store.client.pttl("pdserve:rl:{t}:flight")
    assert 59_000 < bucket_ttl <= 60_000 and 29_000 < flight_ttl <= 30_000


def test_a_dead_gateways_slots_come_back_when_their_leases_lapse(
    redis_server: RedisServer, clock: FakeClock
) -> None:
    dead, alive = (RedisStore(redis_server.url, lease_s=10, clock=clock) for _ in range(2))
    dead.client.flushdb()
    limits = Limits(max_concurrent=1)
    assert dead.take("t", limits, 0, "a").refused is None  # its gateway never settles it
    clock.now = 9.999
    assert alive.take("t", limits, 0, "b").refused is LimitKind.CONCURRENCY
    clock.now = 10.0
    assert alive.take("t", limits, 0, "b") == Taken(None, 0, Levels(0, 0, 1))
    assert dead.settle("t", limits, 0, "a") is None  # lapsed: nothing to give back


def two_gateways_admit(stores: list[RedisStore], limits: Limits) -> list[tuple[int, str]]:
    """8 threads, 4 a gateway, each trying 40 takes, the first of each before any thread goes
    on (so both gateways are in the race: on a loaded host one thread once took the whole
    budget before another ran); returns (gateway, rid) admitted."""
    start, first_round, taken = threading.Barrier(8), threading.Barrier(8), []

    def admit(gateway: int) -> None:
        start.wait()
        for n in range(40):
            rid = f"{gateway}-{threading.get_ident()}-{n}"
            if stores[gateway].take("t", limits, 7, rid).refused is None:
                taken.append((gateway, rid))
            if n == 0:
                first_round.wait()

    threads = [threading.Thread(target=admit, args=(i % 2,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return taken


def test_two_gateways_share_one_budget_exactly(redis_server: RedisServer) -> None:
    stores = [RedisStore(redis_server.url) for _ in range(2)]
    stores[0].client.flushdb()
    limits = Limits(max_concurrent=20)  # no time in it: exact on the server's clock
    taken = two_gateways_admit(stores, limits)
    assert len(taken) == 20 and {gateway for gateway, _ in taken} == {0, 1}
    for gateway, rid in taken * 2:  # each twice, from the other gateway too
        stores[1 - gateway].settle("t", limits, 0, rid)
    assert stores[0].levels("t", limits).in_flight == 0


def test_two_gateways_share_the_request_rate(redis_server: RedisServer) -> None:
    stores = [RedisStore(redis_server.url) for _ in range(2)]
    stores[0].client.flushdb()
    limits = Limits(requests_per_minute=50, tokens_per_minute=1000)  # 142 takes fit the tokens
    before = server_ms(stores[0].client)
    taken = two_gateways_admit(stores, limits)
    elapsed = server_ms(stores[0].client) - before
    assert 50 <= len(taken) <= 50 + elapsed * 50 // UNITS  # what refilled while they ran


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("redis://127.0.0.1:6379/0", RedisAddress("127.0.0.1", 6379, 0)),
        ("redis://cache.internal:7000/3", RedisAddress("cache.internal", 7000, 3)),
        ("redis://[::1]:6380", RedisAddress("::1", 6380, 0)),
    ],
)
def test_urls_parse(url: str, address: RedisAddress) -> None:
    assert parse_url(url) == address


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://localhost/0", "must look like redis://HOST:PORT/DB"),
        ("redis://user:pw@localhost:6379/0", "no user or password"),
        ("rediss://localhost:6379/0", "must look like"),
        ("redis://localhost:6379/0?timeout=1", "must look like"),
        ("redis://localhost:70000/0", "port 70000 is not in 1..65535"),
        ("redis://localhost:0/0", "port 0 is not in"),
        ("redis://" + "a" * 300 + ":1/0", "at most 300 characters"),
    ],
)
def test_bad_urls_are_refused_clearly(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_url(url)


def test_redis_dying_falls_back_to_a_share_and_comes_back(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    server_run = started(tmp_path)
    server = next(server_run)
    try:
        caplog.set_level(logging.WARNING, logger=LOGGER)
        primary = RedisStore(server.url, timeout_s=0.5)
        gateway = FallbackStore(primary, MemoryStore(clock), share=0.5, retry_s=5, clock=clock)
        limits = Limits(tokens_per_minute=100, max_concurrent=4)
        assert gateway.take("t", limits, 10, "r1").refused is None
        assert (gateway.degraded, primary.client.zcard("pdserve:rl:{t}:flight")) == (False, 1)
        server.stop()
        local = [gateway.take("t", limits, 10, f"l{i}") for i in range(3)]  # 2 slots locally
        assert [taken.refused for taken in local] == [None, None, LimitKind.CONCURRENCY]
        assert local[1].levels == Levels(0, 30 * UNITS, 2)  # 50 tokens a minute, 20 taken
        too_large = gateway.take("t", Limits(tokens_per_minute=100), 60, "big")
        assert (too_large.refused, too_large.wait_ms) == (LimitKind.TOKENS, 5_000)
        assert gateway.degraded and gateway.settle("t", limits, 5, "r1") is None
        assert gateway.settle("t", limits, 5, "l0") == Levels(0, 35 * UNITS, 1)
        server.start()  # the same port, empty
        clock.now = 4.999  # not yet time to try again
        assert gateway.levels("t", limits) == Levels(0, 35 * UNITS + 4999 * 50, 1)
        clock.now = 5.0
        assert gateway.levels("t", limits) == Levels(0, 100 * UNITS, 0)
        assert not gateway.degraded
        assert gateway.settle("t", limits, 0, "l1") is not None  # settles where it was taken
        messages = [record.getMessage() for record in caplog.records]
        assert len(messages) == 2, messages
        assert "Redis unreachable" in messages[0] and "0.5 of each" in messages[0]
        assert "Redis is back" in messages[1]
    finally:
        server_run.close()
