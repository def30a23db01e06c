"""gateway.tenancy.ratelimit over the in-memory store, with a fake clock: exact counts at the edges
of a refill, token reservations and their give-back, concurrency, refusals (their waits, 429
bodies and Retry-After), the ``x-ratelimit-*`` headers, OpenAI's duration format, and many
threads admitting at once."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from pdserve.gateway.tenancy.limiter_store import UNITS, Levels, LimiterStore, MemoryStore, Taken
from pdserve.gateway.tenancy.ratelimit import (
    Bucket,
    Decision,
    LimitKind,
    Limits,
    RateLimiter,
    Reservation,
    error_body,
    format_duration,
    headers,
    retry_after,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> LimiterStore:
    """The store under test; ``test_ratelimit_redis`` runs these tests again over Redis."""
    return MemoryStore(clock)


@pytest.fixture
def limiter(store: LimiterStore) -> RateLimiter:
    return RateLimiter(store)


def admitted(decision: Decision) -> Reservation:
    assert decision.reservation is not None, decision
    return decision.reservation


def remaining_tokens(limiter: RateLimiter, limits: Limits, tenant: str = "t") -> int:
    bucket = limiter.usage(tenant, limits).tokens
    assert bucket is not None
    return bucket.remaining


def test_limits_take_none_for_unlimited_and_refuse_zero() -> None:
    assert Limits() == Limits(None, None, None)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tokens_per_minute must be a positive integer"):
            Limits(tokens_per_minute=bad)  # type: ignore[arg-type]


def test_requests_refill_to_the_exact_millisecond(clock: FakeClock, limiter: RateLimiter) -> None:
    limits = Limits(requests_per_minute=60)  # one request a second
    assert all(limiter.admit("t", limits, 0, 0).admitted for _ in range(60))
    refused = limiter.admit("t", limits, 0, 0)
    assert (refused.refused, refused.retry_after_s) == (LimitKind.REQUESTS, 1.0)
    clock.now = 0.999
    assert limiter.admit("t", limits, 0, 0).retry_after_s == 0.001
    clock.now = 1.0
    assert limiter.admit("t", limits, 0, 0).admitted
    assert limiter.admit("t", limits, 0, 0).retry_after_s == 1.0  # that one was the only one
    clock.now = 60.0
    assert limiter.usage("t", limits).requests == Bucket(limit=60, remaining=59, reset_ms=1000)
    clock.now = 61.0
    assert limiter.usage("t", limits).requests == Bucket(limit=60, remaining=60, reset_ms=0)
    clock.now = 600.0  # capped at the capacity, however long idle
    assert sum(limiter.admit("t", limits, 0, 0).admitted for _ in range(100)) == 60


def test_tokens_refill_exactly_at_an_uneven_rate(clock: FakeClock, limiter: RateLimiter) -> None:
    limits = Limits(tokens_per_minute=7)  # a token every 8571.43 ms
    assert limiter.admit("t", limits, 7, 0).admitted
    clock.now = 8.571
    assert limiter.admit("t", limits, 1, 0).retry_after_s == 0.001
    clock.now = 8.572
    assert limiter.admit("t", limits, 1, 0).admitted  # 60,004 units: 4 carried over
    clock.now = 17.142
    assert remaining_tokens(limiter, limits) == 0
    clock.now = 17.143  # (60,000 - 4) / 7 = 8570.9 ms later, rounded up
    assert remaining_tokens(limiter, limits) == 1


def test_max_tokens_is_reserved_and_the_unused_part_given_back(
    clock: FakeClock, limiter: RateLimiter
) -> None:
    limits = Limits(tokens_per_minute=1000)
    streams = [limiter.admit("t", limits, 10, 200) for _ in range(5)]
    assert [d.admitted for d in streams] == [True, True, True, True, False]
    assert remaining_tokens(limiter, limits) == 160  # 4 x 210 held, though nothing generated
    # 210 wanted, 160 there: 50 tokens at 1000/min is 3 s
    assert (streams[4].refused, streams[4].retry_after_s) == (LimitKind.TOKENS, 3.0)
    for decision in streams[:4]:
        limiter.finish(admitted(decision), completion_tokens=50)
    assert remaining_tokens(limiter, limits) == 160 + 4 * 150


def test_an_abort_gives_back_what_was_not_charged_and_finishing_twice_is_a_no_op(
    limiter: RateLimiter,
) -> None:
    limits = Limits(tokens_per_minute=1000, max_concurrent=1)
    reservation = admitted(limiter.admit("t", limits, 100, 400))
    limiter.charge(reservation, 30)
    limiter.charge(reservation, 20)  # counts are cumulative: a smaller one changes nothing
    assert reservation.completion_tokens == 30
    assert remaining_tokens(limiter, limits) == 500  # the charges move nothing in the bucket
    usage = limiter.finish(reservation)  # aborted: the 30 charged are kept, 370 come back
    assert usage is not None and usage.tokens is not None
    assert (usage.tokens.remaining, usage.in_flight) == (870, 0)
    assert limiter.finish(reservation, completion_tokens=0) is None
    limiter.charge(reservation, 400)  # after the end: ignored
    assert (remaining_tokens(limiter, limits), reservation.completion_tokens) == (870, 30)


def test_what_comes_back_fills_the_bucket_no_higher_than_its_limit(
    clock: FakeClock, limiter: RateLimiter
) -> None:
    limits = Limits(tokens_per_minute=100)
    reservation = admitted(limiter.admit("t", limits, 0, 50))
    clock.now = 30.0
    assert remaining_tokens(limiter, limits) == 100  # refilled while it ran
    usage = limiter.finish(reservation, completion_tokens=0)
    assert usage is not None and usage.tokens == Bucket(limit=100, remaining=100, reset_ms=0)
    assert limiter.admit("t", limits, 0, 100).admitted
    assert limiter.admit("t", limits, 0, 1).refused is LimitKind.TOKENS


def test_an_overrun_is_paid_as_a_debt(clock: FakeClock, limiter: RateLimiter) -> None:
    limits = Limits(tokens_per_minute=100)
    limiter.finish(admitted(limiter.admit("t", limits, 0, 100)), completion_tokens=150)
    usage = limiter.usage("t", limits)
    assert usage.tokens is not None
    assert (usage.tokens.remaining, usage.tokens.reset_ms) == (0, 90_000)  # -50: 150 to refill
    assert headers(usage)["x-ratelimit-reset-tokens"] == "1m30s"
    assert limiter.admit("t", limits, 1, 0).retry_after_s == 30.6  # 51 tokens at 100/min
    clock.now = 30.6
    assert limiter.admit("t", limits, 1, 0).admitted


def test_a_request_larger_than_the_token_limit_is_refused_for_good(limiter: RateLimiter) -> None:
    limits = Limits(requests_per_minute=10, tokens_per_minute=1000)
    decision = limiter.admit("t", limits, 900, 101)
    assert (decision.refused, decision.too_large, retry_after(decision)) == (
        LimitKind.TOKENS,
        True,
        None,
    )
    assert error_body(decision) == {
        "error": {
            "message": "Request too large on tokens per min (TPM): Limit 1000, Requested 1001. "
            "Reduce the prompt or max_tokens.",
            "type": "tokens",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    usage = decision.usage  # nothing was taken
    assert usage.requests is not None and usage.tokens is not None
    assert (usage.requests.remaining, usage.tokens.remaining) == (10, 1000)
    assert limiter.admit("t", limits, 900, 100).admitted  # exactly the limit fits


def test_concurrency_counts_requests_in_flight(limiter: RateLimiter) -> None:
    limits = Limits(max_concurrent=2)
    first, second = (admitted(limiter.admit("t", limits, 1, 1)) for _ in range(2))
    refused = limiter.admit("t", limits, 1, 1)
    assert (refused.refused, refused.retry_after_s, refused.usage.in_flight) == (
        LimitKind.CONCURRENCY,
        1.0,
        2,
    )
    assert error_body(refused)["error"] == {
        "message": "Rate limit reached on requests in flight: Limit 2. "
        "Please try again when one of them ends.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    limiter.finish(first, 1)
    limiter.finish(first, 1)  # a second finish releases no second slot
    assert limiter.admit("t", limits, 1, 1).admitted
    assert limiter.admit("t", limits, 1, 1).refused is LimitKind.CONCURRENCY
    assert limiter.admit("other", limits, 1, 1).admitted  # tenants are apart
    limiter.finish(second)
    assert limiter.usage("t", limits).in_flight == 1


def test_the_longer_wait_binds_and_is_reported(limiter: RateLimiter) -> None:
    limits = Limits(requests_per_minute=2, tokens_per_minute=600)  # 1 per 30 s; 10 per s
    assert limiter.admit("t", limits, 0, 600).admitted  # the tokens are gone
    short_of_tokens = limiter.admit("t", limits, 10, 0)
    assert (short_of_tokens.refused, short_of_tokens.retry_after_s) == (LimitKind.TOKENS, 1.0)
    assert limiter.admit("t", limits, 0, 0).admitted  # no tokens asked: the last request
    both = limiter.admit("t", limits, 10, 0)
    assert (both.refused, both.retry_after_s, retry_after(both)) == (LimitKind.REQUESTS, 30.0, "30")
    assert error_body(both)["error"]["message"] == (
        "Rate limit reached on requests per min (RPM): Limit 2, Remaining 0, Requested 1. "
        "Please try again in 30s."
    )
    assert error_body(short_of_tokens)["error"]["message"] == (
        "Rate limit reached on tokens per min (TPM): Limit 600, Remaining 0, Requested 10. "
        "Please try again in 1s."
    )
    assert error_body(short_of_tokens)["error"]["type"] == "tokens"


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    usage = RateLimiter(MemoryStore()).usage("t", Limits())
    for wait, header in (
        (0.0, "1"),
        (0.001, "1"),
        (1.0, "1"),
        (1.001, "2"),
        (30.6, "31"),
        (None, None),
    ):
        decision = Decision(usage, 1, refused=LimitKind.TOKENS, retry_after_s=wait)
        assert retry_after(decision) == header
    with pytest.raises(ValueError, match="no error body"):
        error_body(Decision(usage, 1))


def test_headers_are_exact_and_in_openais_order(clock: FakeClock, limiter: RateLimiter) -> None:
    limits = Limits(requests_per_minute=60, tokens_per_minute=1000)
    decision = limiter.admit("t", limits, 10, 90)
    assert list(headers(decision.usage).items()) == [
        ("x-ratelimit-limit-requests", "60"),
        ("x-ratelimit-limit-tokens", "1000"),
        ("x-ratelimit-remaining-requests", "59"),
        ("x-ratelimit-remaining-tokens", "900"),
        ("x-ratelimit-reset-requests", "1s"),
        ("x-ratelimit-reset-tokens", "6s"),  # 100 tokens at 1000/min
    ]
    clock.now = 2.5
    usage = limiter.finish(admitted(decision), completion_tokens=40)  # 50 back, 41.6 refilled
    assert usage is not None
    assert headers(usage)["x-ratelimit-remaining-tokens"] == "991"
    assert headers(usage)["x-ratelimit-reset-tokens"] == "500ms"  # 8.33 tokens to go
    assert headers(usage)["x-ratelimit-reset-requests"] == "0s"
    only_tokens = limiter.usage("u", Limits(tokens_per_minute=5, max_concurrent=3))
    assert headers(only_tokens) == {
        "x-ratelimit-limit-tokens": "5",
        "x-ratelimit-remaining-tokens": "5",
        "x-ratelimit-reset-tokens": "0s",
    }
    assert headers(limiter.usage("u", Limits())) == {}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1.0, "0s"),
        (0.0001, "1ms"),  # rounded up: waiting that long is enough
        (0.25, "250ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.2, "1.2s"),
        (1.0004, "1.001s"),
        (17.281, "17.281s"),
        (60, "1m0s"),
        (86.4, "1m26.4s"),
        (360, "6m0s"),
        (3600, "1h0m0s"),
        (3723, "1h2m3s"),
        (3723.05, "1h2m3.05s"),
    ],
)
def test_format_duration_as_openai_sends_it(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_unlimited_admits_everything_and_still_counts_in_flight(limiter: RateLimiter) -> None:
    reservations = [admitted(limiter.admit("t", Limits(), 10**6, 10**6)) for _ in range(100)]
    assert limiter.usage("t", Limits()).in_flight == 100
    for reservation in reservations:
        limiter.finish(reservation, 5)
    assert limiter.usage("t", Limits()).in_flight == 0


def test_a_clock_going_back_refills_nothing(clock: FakeClock, limiter: RateLimiter) -> None:
    limits = Limits(requests_per_minute=60)
    clock.now = 10.0
    assert sum(limiter.admit("t", limits, 0, 0).admitted for _ in range(61)) == 60
    clock.now = 5.0
    assert limiter.admit("t", limits, 0, 0).retry_after_s == 1.0
    clock.now = 11.0  # a second after the latest time seen: one request, not six
    assert sum(limiter.admit("t", limits, 0, 0).admitted for _ in range(3)) == 1


def test_bad_counts_are_refused(limiter: RateLimiter) -> None:
    with pytest.raises(ValueError, match="prompt_tokens must be a non-negative integer"):
        limiter.admit("t", Limits(), -1, 0)
    reservation = admitted(limiter.admit("t", Limits(), 1, 1))
    with pytest.raises(ValueError, match="completion_tokens_so_far"):
        limiter.charge(reservation, -1)
    with pytest.raises(ValueError, match="completion_tokens must be a non-negative integer"):
        limiter.finish(reservation, -1)
    assert limiter.finish(reservation, 1) is not None  # the bad finish changed nothing


def test_the_store_settles_a_reservation_once(store: LimiterStore) -> None:
    """The store's own contract, which a Redis store must keep too: ``take`` is all or
    nothing, and a reservation id is settled once however often it is named."""
    limits = Limits(requests_per_minute=2, tokens_per_minute=100)
    assert store.take("t", limits, 60, "a") == Taken(None, 0, Levels(60_000, 40 * UNITS, 1))
    refused = store.take("t", limits, 50, "b")  # 10 tokens short at 100/min: 6 s
    assert refused == Taken(LimitKind.TOKENS, 6_000, Levels(60_000, 40 * UNITS, 1))
    assert store.settle("t", limits, 30, "b") is None  # never taken: nothing back
    assert store.settle("t", limits, 30, "a") == Levels(60_000, 70 * UNITS, 0)
    assert store.settle("t", limits, 30, "a") is None
    assert store.levels("t", limits) == Levels(60_000, 70 * UNITS, 0)
    with pytest.raises(ValueError, match="101 tokens can never fit a bucket of 100"):
        store.take("t", limits, 101, "c")


@pytest.fixture
def often_switching() -> Iterator[None]:
    """Threads switch every microsecond, so a missing lock shows."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def in_threads(count: int, work: Callable[[], None]) -> None:
    threads = [threading.Thread(target=work) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.mark.usefixtures("often_switching")
@pytest.mark.parametrize("tenant", [f"t{i}" for i in range(5)])  # a race shows in some rounds
def test_threads_admitting_at_once_take_exactly_the_capacity(
    limiter: RateLimiter, tenant: str
) -> None:
    limits = Limits(requests_per_minute=50, tokens_per_minute=1000, max_concurrent=1000)
    start = threading.Barrier(8)
    taken: list[Reservation] = []

    def admit() -> None:
        start.wait()
        for _ in range(40):
            decision = limiter.admit(tenant, limits, 7, 0)  # 142 fit the tokens, 50 the requests
            if decision.reservation is not None:
                taken.append(decision.reservation)  # list.append is atomic

    in_threads(8, admit)
    assert len(taken) == 50
    assert remaining_tokens(limiter, limits, tenant) == 1000 - 50 * 7
    finishing = iter(taken * 2)  # each twice: one of the two releases it

    def finish() -> None:
        for reservation in finishing:
            limiter.finish(reservation, 0)

    in_threads(8, finish)
    assert limiter.usage(tenant, limits).in_flight == 0
