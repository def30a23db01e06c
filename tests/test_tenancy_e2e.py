"""Tenants end to end through ``pdserve serve`` (disaggregated and colocated): keys made by
``pdserve keys add``, a flooding tenant held to its limit with exact 429s and headers while a
steady tenant's requests all succeed, ``pdserve usage`` equal to the sum of the responses'
``usage`` once the gateway stopped cleanly, and SIGHUP to serve reloading the tenants file (a
changed limit takes effect with a stream in flight; a malformed file is refused, logged with
its line, and the old limits stay).

Limits count on the gateway's real clock. The flooder's bucket holds 3 requests and gets one
back every 20 s, so the flood (all of it sent at once) is admitted exactly 3 times as long as
it reaches the gateway within 20 s of its first request; every other figure checked is exact
whatever the timing (a 429's ``Retry-After`` and its reset are tied by the bucket's size)."""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e_util import PDSERVE, ServedCluster
from tests.gateway_util import wait_until

RPM = 3  # the flooder's requests a minute: one back every 20 s
TPM = 400  # its tokens a minute: never binding for its RPM requests below
CAP = 64  # its max_tokens per request
FLOOD = 24  # flooder requests sent at once: 8 times its limit
TENANTS = f"""# two tenants: one floods, one does not
[tenants.flooder]
tier = "batch"
requests_per_minute = {RPM}
tokens_per_minute = {TPM}
max_tokens = {CAP}
keys = []

[tenants.steady]
requests_per_minute = 1000
tokens_per_minute = 1000000
"""
RELOADED_RPM = 600
LONG_STREAM = 1500  # tokens: still streaming while the reload is checked
MODES = {"disagg": (), "colocated": ("--mode=colocated",)}


@dataclass
class Ledger:
    """What the responses said each tenant used: the figures ``pdserve usage`` must give."""

    requests: dict[str, Counter[str]] = field(default_factory=dict)
    tokens: dict[str, Counter[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, tenant: str, status: int, usage: dict[str, Any] | None) -> None:
        outcome = {200: "success", 429: "rejected"}[status]
        with self.lock:
            self.requests.setdefault(tenant, Counter())[outcome] += 1
            tokens = self.tokens.setdefault(tenant, Counter())
            if status == 200:
                assert usage is not None
                tokens["prompt_tokens"] += usage["prompt_tokens"]
                tokens["completion_tokens"] += usage["completion_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                tokens["cached_tokens"] += cached


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    body: dict[str, Any]  # the JSON body; a stream's last chunk with choices, with its usage
    events: list[str]  # a stream's data lines


@dataclass
class Served:
    cluster: ServedCluster
    tenants: Path
    usage_db: Path
    keys: dict[str, str]
    ledger: Ledger = field(default_factory=Ledger)

    def complete(self, tenant: str, **body: Any) -> Answer:
        """A completion for ``tenant``, entered in the ledger (a 200 or a 429)."""
        payload = {"model": self.cluster.model_name, "prompt": "Hello there", **body}
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        if "messages" in body:
            payload.pop("prompt")
        url = f"{self.cluster.url}{path}"
        if not body.get("stream"):
            r = httpx.post(url, json=payload, headers=headers, timeout=120)
            answer = Answer(r.status_code, r.headers, r.json(), [])
        else:
            with httpx.stream("POST", url, json=payload, headers=headers, timeout=120) as r:
                if r.status_code != 200:
                    r.read()
                    return self._entered(tenant, Answer(r.status_code, r.headers, r.json(), []))
                events = list(data_events(r))
            answer = Answer(r.status_code, r.headers, _last_chunk(events), events)
        return self._entered(tenant, answer)

    def _entered(self, tenant: str, answer: Answer) -> Answer:
        if answer.status in (200, 429):
            self.ledger.add(tenant, answer.status, answer.body.get("usage"))
        return answer


def data_events(response: httpx.Response) -> Iterator[str]:
    """A stream's ``data:`` payloads, lines split at LF only: the gateway writes JSON with
    ``ensure_ascii=False``, and a sampled U+2028 or U+0085 would cut ``iter_lines``' lines."""
    pending = ""
    for text in response.iter_text():
        *lines, pending = (pending + text).split("\n")
        yield from (line[6:] for line in lines if line.startswith("data: "))
    if pending.startswith("data: "):
        yield pending[6:]


def _last_chunk(events: list[str]) -> dict[str, Any]:
    """A stream's last choice chunk, with the usage of its final chunk folded in."""
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    last = next(c for c in reversed(chunks) if c.get("choices"))
    return {**last, "usage": chunks[-1].get("usage")}


def pdserve(*args: str) -> str:
    """The real CLI's stdout; fails the test with its stderr when it fails."""
    done = subprocess.run([*PDSERVE, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def tenants_with_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """The tenants file's text once ``pdserve keys add`` gave each tenant a key, and the keys."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS, encoding="utf-8")
    keys = {
        t: pdserve("keys", "add", t, f"--tenants={path}").strip() for t in ("flooder", "steady")
    }
    return path.read_text(encoding="utf-8"), keys


@pytest.fixture(params=list(MODES))
def served(
    request: pytest.FixtureRequest, tiny_dir: Path, tmp_path: Path, tenants_with_keys
) -> Iterator[Served]:
    text, keys = tenants_with_keys
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(text, encoding="utf-8")
    usage_db = tmp_path / "usage.db"
    flags = [f"--tenants={tenants}", f"--usage-db={usage_db}", "--num-kv-blocks=512"]
    cluster = ServedCluster(tiny_dir, *flags, *MODES[request.param])
    try:
        yield Served(cluster, tenants, usage_db, keys)
    finally:
        cluster.stop()


def ratelimit(answer: Answer) -> dict[str, str]:
    return {k: v for k, v in answer.headers.items() if k.startswith("x-ratelimit-")}


def duration_ms(text: str) -> int:
    """``format_duration``'s text back to ms: ``250ms``, ``59.5s``, ``1m0s``."""
    if text.endswith("ms"):
        return int(text[:-2])
    found = re.fullmatch(r"(?:(\d+)m)?(\d+(?:\.\d+)?)s", text)
    assert found, text
    return int(found.group(1) or 0) * 60_000 + round(float(found.group(2)) * 1000)


def flood(s: Served) -> tuple[list[Answer], list[Answer]]:
    """Every flooder request at once, the steady tenant's four among them."""
    start = threading.Barrier(FLOOD + 4)

    def flooder(_: int) -> Answer:
        start.wait()
        return s.complete("flooder", max_tokens=4, ignore_eos=True)

    def steady(i: int) -> Answer:
        start.wait()
        body: dict[str, Any] = {"max_tokens": 6, "ignore_eos": True}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"Hi {i}"}]
        if i >= 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return s.complete("steady", **body)

    with ThreadPoolExecutor(FLOOD + 4) as pool:
        floods = [pool.submit(flooder, i) for i in range(FLOOD)]
        steadies = [pool.submit(steady, i) for i in range(4)]
        return [f.result() for f in floods], [f.result() for f in steadies]


def check_flood(flooded: list[Answer], steady: list[Answer]) -> None:
    admitted = [a for a in flooded if a.status == 200]
    refused = [a for a in flooded if a.status == 429]
    assert (len(admitted), len(refused)) == (RPM, FLOOD - RPM)
    cost = admitted[0].body["usage"]["prompt_tokens"] + 4  # prompt + max_tokens at admission
    admitted.sort(key=lambda a: -int(ratelimit(a)["x-ratelimit-remaining-requests"]))
    for k, a in enumerate(admitted, 1):
        assert a.body["usage"]["completion_tokens"] == 4
        h = ratelimit(a)
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-limit-tokens"]) == (
            str(RPM),
            str(TPM),
        )
        assert h["x-ratelimit-remaining-requests"] == str(RPM - k)
        # k admissions took k * cost; the bucket refilled a little meanwhile, never past full
        assert TPM - k * cost <= int(h["x-ratelimit-remaining-tokens"]) <= TPM - cost
    for a in refused:
        error = a.body["error"]
        assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
        assert error["message"].startswith(
            f"Rate limit reached on requests per min (RPM): Limit {RPM}, Remaining 0, Requested 1."
        )
        h = ratelimit(a)
        assert h["x-ratelimit-limit-requests"] == str(RPM)
        assert h["x-ratelimit-remaining-requests"] == "0"
        assert h["x-ratelimit-limit-tokens"] == str(TPM)
        # under one request left: full again in (2/3 min, 1 min]; one request back 40 s sooner
        reset = duration_ms(h["x-ratelimit-reset-requests"])
        assert 40_000 < reset <= 60_000
        assert a.headers["retry-after"] == str(max(1, math.ceil((reset - 40_000) / 1000)))
    for a in steady:
        assert a.status == 200, a.body
        assert a.body["usage"]["completion_tokens"] == 6
        assert a.body["choices"][0]["finish_reason"] == "length"
        h = ratelimit(a)
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-limit-tokens"]) == (
            "1000",
            "1000000",
        )
        assert 996 <= int(h["x-ratelimit-remaining-requests"]) <= 999


def check_too_large(s: Served) -> None:
    """prompt + max_tokens beyond the flooder's token bucket: refused on tokens, with no
    ``Retry-After`` (no wait lets it in), taking nothing."""
    a = s.complete("flooder", prompt=[5] * (TPM - 3), max_tokens=4)
    assert a.status == 429
    error = a.body["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "tokens")
    assert error["message"] == (
        f"Request too large on tokens per min (TPM): Limit {TPM}, Requested {TPM + 1}. "
        "Reduce the prompt or max_tokens."
    )
    assert "retry-after" not in a.headers
    h = ratelimit(a)
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-limit-requests"]) == (str(TPM), str(RPM))


def probe(s: Served) -> Answer:
    """The flooder's standing now, through a request over its max_tokens: a 400 before
    admission, which takes nothing and is not metered."""
    payload = {"model": s.cluster.model_name, "prompt": "x", "max_tokens": CAP + 1}
    headers = {"Authorization": f"Bearer {s.keys['flooder']}"}
    r = httpx.post(f"{s.cluster.url}/v1/completions", json=payload, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_exceeded"
    return Answer(r.status_code, r.headers, r.json(), [])


def check_sighup(s: Served) -> None:
    """A changed file takes effect on SIGHUP with a stream in flight, which ends well; then a
    malformed one is refused, logged with its line, and the limits in force stay."""
    c = s.cluster
    headers = {"Authorization": f"Bearer {s.keys['steady']}"}
    body = {
        "model": c.model_name,
        "prompt": "A long story",
        "max_tokens": LONG_STREAM,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{c.url}/v1/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200
        stream = data_events(r)
        events = [next(stream)]
        text = s.tenants.read_text(encoding="utf-8")
        s.tenants.write_text(
            text.replace(
                f"requests_per_minute = {RPM}\n", f"requests_per_minute = {RELOADED_RPM}\n"
            ),
            encoding="utf-8",
        )
        c.proc.send_signal(signal.SIGHUP)
        wait_until(
            lambda: ratelimit(probe(s))["x-ratelimit-limit-requests"] == str(RELOADED_RPM),
            what="the reloaded limit",
        )
        assert c.gateway_in_flight() == 1  # the stream still runs across the reload
        # 600 a minute: a request back every 100 ms, so the flooder is let in again
        wait_until(lambda: ratelimit(probe(s))["x-ratelimit-remaining-requests"] != "0")
        again = s.complete("flooder", max_tokens=4, ignore_eos=True)
        assert again.status == 200, again.body
        assert ratelimit(again)["x-ratelimit-limit-requests"] == str(RELOADED_RPM)
        malformed = s.tenants.read_text(encoding="utf-8").replace(
            f"tokens_per_minute = {TPM}\n", "tokens_per_minute = 0\n"
        )
        s.tenants.write_text(malformed, encoding="utf-8")
        line = malformed.splitlines().index("tokens_per_minute = 0") + 1
        c.proc.send_signal(signal.SIGHUP)
        refusal = f"tenants file refused, the previous one stays in force: {s.tenants}:{line}: "
        wait_until(lambda: refusal in c.output(), what="the refusal in the log")
        assert "tokens_per_minute must be an integer >= 1" in c.output().split(refusal, 1)[1]
        h = ratelimit(probe(s))
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-limit-tokens"]) == (
            str(RELOADED_RPM),
            str(TPM),
        )
        events += stream
    last = _last_chunk(events)
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == LONG_STREAM
    s.ledger.add("steady", 200, last["usage"])


def check_usage(s: Served) -> None:
    """Once serve stopped cleanly, ``pdserve usage`` gives what the responses said."""
    used = s.cluster.wait_blocks_free()
    assert used and set(used.values()) == {0.0}, used
    s.cluster.stop()
    assert s.cluster.proc.returncode == 0, s.cluster.output()[-3000:]
    out = pdserve("usage", f"--usage-db={s.usage_db}", "--since=2000-01-01", "--json")
    found = {t["tenant"]: t for t in json.loads(out)["tenants"]}
    assert set(found) == {"flooder", "steady"}
    for tenant, row in found.items():
        requests = s.ledger.requests[tenant]
        assert row["requests"] == {
            "total": sum(requests.values()),
            "success": requests["success"],
            "aborted": 0,
            "error": 0,
            "timeout": 0,
            "rejected": requests["rejected"],
            "invalid": 0,
        }
        tokens = s.ledger.tokens[tenant]
        for kind in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            assert row[kind] == tokens[kind], (tenant, kind)
        assert [m["model"] for m in row["models"]] == [s.cluster.model_name]


def test_flood_usage_and_reload(served: Served, request: pytest.FixtureRequest) -> None:
    flooded, steady = flood(served)
    check_flood(flooded, steady)
    check_too_large(served)
    if request.node.callspec.params["served"] == "disagg":  # one mode is enough for SIGHUP
        check_sighup(served)
    check_usage(served)
