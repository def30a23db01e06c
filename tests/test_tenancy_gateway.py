"""Tenants through the gateway over real HTTP (uvicorn on loopback, the fake backend behind it):
keys name tenants, admission takes prompt + max_tokens, a stream is charged and the unused part
given back, every answer carries the x-ratelimit-* headers, refusals are OpenAI 429s, and
usage is metered in /metrics and the SQLite record. The store's clock stands still, so every
count is exact."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.app import create_app
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.metrics import Outcome
from pdserve.gateway.tenancy.core import Tenancy
from pdserve.gateway.tenancy.limiter_store import MemoryStore
from pdserve.gateway.tenancy.meter import UsageMeter
from pdserve.gateway.tenancy.ratelimit import RateLimiter, format_duration
from pdserve.gateway.tenancy.tenants import TenantsFile, hash_key
from pdserve.gateway.tenancy.usage import UsageStore
from pdserve.protocol.tenancy import Share, Tier
from tests.gateway_util import MODELS, FakeBackend, Script, parse_prometheus, running_server

TENANTS = """
[tenants.acme]
requests_per_minute = 3
tokens_per_minute = 1000
max_tokens = 50
keys = ["{acme}"]

[tenants.solo]
max_concurrent = 1
keys = ["{solo}"]

[tenants.free]
keys = ["{free}"]
"""
KEYS = {"acme": "sk-acme", "solo": "sk-solo", "free": "sk-free"}


def write_tenants(path: Path, text: str = TENANTS) -> None:
    path.write_text(text.format(**{t: hash_key(k) for t, k in KEYS.items()}), encoding="utf-8")


@dataclass
class Gw:
    url: str
    backend: FakeBackend
    tenancy: Tenancy
    clock: list[float]

    def stream(self, tenant: str, **body: object) -> AbstractContextManager[httpx.Response]:
        """A streamed completion of ``body``'s for ``tenant``'s key."""
        payload = {"model": "tiny", "stream": True, **body}
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        url = f"{self.url}/v1/completions"
        return httpx.stream("POST", url, json=payload, headers=headers, timeout=30)

    def post(self, tenant: str, stream: bool = False, **body: object) -> httpx.Response:
        payload = {"model": "tiny", "prompt": "Hi there", "stream": stream, **body}
        headers = {"Authorization": f"Bearer {KEYS.get(tenant, tenant)}"}
        return httpx.post(f"{self.url}/v1/completions", json=payload, headers=headers, timeout=30)


@pytest.fixture
def gw(tok: Tokenizer, tmp_path: Path) -> Iterator[Gw]:
    write_tenants(tmp_path / "tenants.toml")
    clock = [1000.0]
    meter = UsageMeter(UsageStore(tmp_path / "usage.db"), batch_interval_s=0.01)
    tenancy = Tenancy(
        TenantsFile(tmp_path / "tenants.toml"),
        limiter=RateLimiter(MemoryStore(clock=lambda: clock[0])),
        meter=meter,
    )
    eos = tok.eos_token_ids[0]
    backend = FakeBackend(MODELS, Script([[*tok.encode("ok ok ok", False), eos]]))
    app = create_app(backend, {"tiny": tok}, config=GatewayConfig(), tenancy=tenancy)
    with running_server(app) as url:
        yield Gw(url, backend, tenancy, clock)
    tenancy.close()


def limits(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("x-ratelimit-")}


def test_admission_charges_and_gives_back_exactly(gw: Gw) -> None:
    first = gw.post("acme", max_tokens=10)
    assert first.status_code == 200
    usage = first.json()["usage"]
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    assert 0 < completion < 10
    # the headers tell the standing at admission: 1 request and prompt + 10 tokens taken
    assert limits(first) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-remaining-tokens": str(1000 - prompt - 10),
        "x-ratelimit-reset-requests": "20s",  # 1 request of 3/min comes back in 20 s
        "x-ratelimit-reset-tokens": format_duration((prompt + 10) * 0.060),
    }
    # a stream: charged what it generated, 10 - completion given back at its end
    with gw.stream("acme", prompt="Hi there", max_tokens=10) as streamed:
        assert streamed.status_code == 200
        assert limits(streamed)["x-ratelimit-remaining-requests"] == "1"
        left = 1000 - prompt - completion - prompt - 10
        assert limits(streamed)["x-ratelimit-remaining-tokens"] == str(left)
        body = "".join(streamed.iter_text())
    assert body.rstrip().endswith("data: [DONE]")
    third = gw.post("acme", max_tokens=5)
    assert limits(third)["x-ratelimit-remaining-tokens"] == str(
        1000 - 3 * prompt - 2 * completion - 5
    )
    assert limits(third)["x-ratelimit-remaining-requests"] == "0"
    # the fourth: over 3 requests a minute
    refused = gw.post("acme", max_tokens=5)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "20"
    assert limits(refused)["x-ratelimit-remaining-requests"] == "0"
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
    assert error["message"].startswith("Rate limit reached on requests per min (RPM): Limit 3")
    gw.clock[0] += 20.0  # one request back, and 20 s of tokens (1000/min)
    assert gw.post("acme", max_tokens=5).status_code == 200
    assert len(gw.backend.submitted) == 4


def test_token_limits_and_max_tokens(gw: Gw) -> None:
    too_many = gw.post("acme", max_tokens=51)
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "max_tokens"
    assert "more than this key's limit of 50" in too_many.json()["error"]["message"]
    assert limits(too_many)["x-ratelimit-remaining-requests"] == "3"  # the standing now
    assert gw.post("acme").status_code == 200  # no max_tokens: the tenant's 50, not 16
    assert gw.backend.submitted[-1].sampling.max_tokens == 16  # completions' default is below
    chat = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
        headers={"Authorization": "Bearer sk-acme"},
    )
    assert chat.status_code == 200
    assert gw.backend.submitted[-1].sampling.max_tokens == 50  # the room left, capped
    assert gw.backend.submitted[-1].share == Share(tenant="acme", tier=Tier.STANDARD, weight=1)
    # prompt + n * max_tokens beyond the bucket: no wait helps, so no Retry-After
    big = gw.post("acme", prompt=["Hi", "Yo"], max_tokens=50, n=16, temperature=1.0)
    assert big.status_code == 429 and "retry-after" not in big.headers
    assert big.json()["error"]["message"].startswith("Request too large on tokens per min")
    assert len(gw.backend.submitted) == 2


def test_concurrency_slot_held_by_a_stream_and_freed_at_its_end(gw: Gw, tok: Tokenizer) -> None:
    gw.backend.script = Script([[*tok.encode("ok ok", False)]], hang_after=1)
    with gw.stream("solo", prompt="Hi", max_tokens=5) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")  # its first event: it runs
        second = gw.post("solo")
        assert second.status_code == 429
        assert second.json()["error"]["message"].startswith("Rate limit reached on requests in")
    # the client left: the stream is aborted and its slot comes back
    gw.backend.script = Script([[*tok.encode("ok", False), tok.eos_token_ids[0]]])
    for _ in range(200):
        if gw.post("solo").status_code == 200:
            break
    else:
        pytest.fail("the slot never came back")
    assert limits(gw.post("free")) == {}  # no limits: no headers


def test_unknown_keys_and_refusals_before_admission(gw: Gw) -> None:
    assert gw.post("sk-nobody").status_code == 401
    gw.backend.script = Script([[1]], reject_status=503)
    refused = gw.post("acme", max_tokens=10)
    assert refused.status_code == 503
    # the backend refused: its tokens come back at once (the request counts, as OpenAI's do)
    after = gw.post("acme", max_tokens=10)
    assert after.status_code == 503
    assert limits(after)["x-ratelimit-remaining-requests"] == "1"
    prompt = 1000 - int(limits(refused)["x-ratelimit-remaining-tokens"]) - 10
    assert limits(after)["x-ratelimit-remaining-tokens"] == str(1000 - prompt - 10)


def test_usage_is_metered_in_metrics_and_the_record(gw: Gw, tmp_path: Path) -> None:
    answers = [gw.post("acme", max_tokens=8), gw.post("free", max_tokens=4)]
    answers += [gw.post("free", max_tokens=4, n=2)]
    for _ in range(3):
        gw.post("acme", max_tokens=8)  # the last is refused (3 a minute)
    sent = {"acme": [0, 0, 0], "free": [0, 0, 0]}
    for tenant, answer in zip(["acme", "free", "free"], answers, strict=True):
        usage = answer.json()["usage"]
        sent[tenant][0] += 1
        sent[tenant][1] += usage["prompt_tokens"]
        sent[tenant][2] += usage["completion_tokens"]
    families = parse_prometheus(httpx.get(f"{gw.url}/metrics").text)

    def value(name: str, **labels: str) -> float:
        _, samples = families[name]
        return samples[(name, tuple(labels.items()))]

    requests, tokens = "pdserve_tenant_requests_total", "pdserve_tenant_tokens_total"
    assert value(requests, tenant="acme", model="tiny", outcome="success") == 3
    assert value(requests, tenant="acme", model="tiny", outcome="rejected") == 1
    assert value("pdserve_rate_limited_total", tenant="acme", limit="requests") == 1
    assert value("pdserve_rate_limit_store_degraded") == 0
    gw.tenancy.close()  # a clean shutdown writes every record
    since = datetime(2000, 1, 1, tzinfo=UTC)
    totals = {t.tenant: t for t in UsageStore(tmp_path / "usage.db").totals(since)}
    free = totals["free"]
    assert (free.request_count, free.prompt_tokens, free.completion_tokens) == tuple(sent["free"])
    assert value(tokens, tenant="free", model="tiny", kind="completion") == sent["free"][2]
    assert totals["acme"].request_count == 4
    assert totals["acme"].requests[Outcome.REJECTED] == 1


def test_sighup_reload_keeps_streams_and_refuses_a_bad_file(gw: Gw, tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    write_tenants(path, TENANTS.replace("requests_per_minute = 3", "requests_per_minute = 600"))
    assert gw.tenancy.reload() is None
    assert limits(gw.post("acme"))["x-ratelimit-limit-requests"] == "600"
    path.write_text("[tenants.acme]\nrequests_per_minute = -1\n", encoding="utf-8")
    error = gw.tenancy.reload()
    assert error is not None and error.line == 2
    assert limits(gw.post("acme"))["x-ratelimit-limit-requests"] == "600"  # the old one stays


def test_api_keys_with_a_tenants_file(tmp_path: Path) -> None:
    write_tenants(tmp_path / "t.toml")
    tenancy = Tenancy(TenantsFile(tmp_path / "t.toml"), api_keys=("sk-admin",))
    assert getattr(tenancy.authenticate(b"sk-admin"), "name", None) == "default"
    assert getattr(tenancy.authenticate(b"sk-acme"), "name", None) == "acme"
    write_tenants(tmp_path / "t.toml", TENANTS + "\n[tenants.default]\nkeys = []\n")
    refused = tenancy.reload()  # a "default" tenant clashes with the keys' one
    assert refused is not None and "rename it" in str(refused)
    assert getattr(tenancy.authenticate(b"sk-admin"), "name", None) == "default"
