"""Gateway access rules over real HTTP (uvicorn on loopback, the fake backend, a test double for
the ZMQ client, behind it): API keys, body size, content type, and the configuration they come
from."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.gateway.config import API_KEY_ENV, GatewayConfig, add_config_args, config_from_args
from pdserve.gateway.main import add_gateway_args, run_gateway
from pdserve.gateway.tenancy.core import OPEN, Tenancy
from tests.gateway_util import COMPLETION, Serve, error, wait_for

# ---- API keys ----------------------------------------------------------------------------------

MISSING_KEY = error("Missing API key: send it as 'Authorization: Bearer <key>'.", "invalid_api_key")
WRONG_KEY = error("Incorrect API key provided.", "invalid_api_key")


def test_api_keys(serve: Serve) -> None:
    served = serve(GatewayConfig(api_keys=("sk-one", "sk-two")))
    url = served.url
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/v1/nope")]:
        response = httpx.request(method, f"{url}{path}", json=COMPLETION)
        assert (response.status_code, response.json()) == (401, MISSING_KEY)
        assert response.headers["www-authenticate"] == "Bearer"
    for header in ["Bearer sk-three", "Bearer sk-one-more", "Basic sk-one", "sk-one", "Bearer"]:
        response = httpx.get(f"{url}/v1/models", headers={"Authorization": header})
        assert (response.status_code, response.json()) == (401, WRONG_KEY)
    assert served.backend.submitted == []
    assert served.metrics.requests.total(outcome="invalid") == 1  # the one generation request
    for key in ("sk-one", "sk-two"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert client.completions.create(model="tiny", prompt="Hi").choices[0].text == "ok"
        assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-bad", max_retries=0).models.list()
    assert refused.value.code == "invalid_api_key"
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(f"{url}{path}").status_code == 200


def test_keys_name_their_tenant() -> None:
    tenancy = Tenancy(api_keys=("sk-one", "sk-two", "sk-é"))
    given = (b"sk-one", b"sk-two", "sk-é".encode(), b"sk-on", b"sk-one ", b"", b"SK-ONE", b"\xff")
    found = [tenancy.authenticate(k) for k in given]
    assert [getattr(t, "name", None) for t in found] == ["default"] * 3 + [None] * 5
    assert [getattr(t, "status", None) for t in found[3:]] == [401] * 5
    assert getattr(tenancy.authenticate(None), "message", "").startswith("Missing API key")
    assert Tenancy().authenticate(None) is OPEN and Tenancy().authenticate(b"any") is OPEN


def test_no_keys_means_open(serve: Serve) -> None:
    url = serve(GatewayConfig()).url
    response = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer anything"})
    assert response.status_code == 200


# ---- body size and content type ----------------------------------------------------------------


def padded(size: int) -> bytes:
    """A valid completion body of exactly ``size`` bytes (JSON whitespace pads it)."""
    body = json.dumps(COMPLETION).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def chunked(body: bytes) -> Iterator[bytes]:
    """Sent without Content-Length: the limit is enforced while reading."""
    yield from (body[i : i + 100] for i in range(0, len(body), 100))


def test_body_size_limit(serve: Serve) -> None:
    served = serve(GatewayConfig(max_body_bytes=1000))
    url = f"{served.url}/v1/completions"
    headers = {"content-type": "application/json"}
    too_large = error(
        "The request body is larger than this server's limit of 1000 bytes.", "request_too_large"
    )
    assert httpx.post(url, content=padded(1000), headers=headers).status_code == 200
    response = httpx.post(url, content=padded(1001), headers=headers)
    assert (response.status_code, response.json()) == (413, too_large)
    response = httpx.post(url, content=chunked(padded(1001)), headers=headers)
    assert "content-length" not in response.request.headers
    assert (response.status_code, response.json()) == (413, too_large)
    assert httpx.post(url, content=chunked(padded(1000)), headers=headers).status_code == 200
    assert len(served.backend.submitted) == 2
    # the slot is let go just after the response's last byte
    assert wait_for(lambda: served.admission.in_flight == 0)


@pytest.mark.parametrize(
    ("content_type", "shown"),
    [(None, "no content type"), ("text/plain", "'text/plain'"),
     ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded'")],
)  # fmt: skip
def test_content_type_must_be_json(serve: Serve, content_type: str | None, shown: str) -> None:
    served = serve(GatewayConfig())
    url = f"{served.url}/v1/completions"
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps(COMPLETION).encode()
    response = httpx.post(url, content=body, headers=headers)
    message = f"Unsupported Media Type: only 'application/json' is allowed, got {shown}."
    assert (response.status_code, response.json()) == (
        415, error(message, "unsupported_media_type"),
    )  # fmt: skip
    headers = {"content-type": "Application/JSON; charset=utf-8"}
    assert httpx.post(url, content=body, headers=headers).status_code == 200
    assert len(served.backend.submitted) == 1


# ---- configuration -----------------------------------------------------------------------------


def test_config_from_args(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("sk-file-1\n\n  sk-file-2  \nsk-cli\n")
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(
        ["--api-key", "sk-cli", "--api-key-file", str(key_file), "--request-timeout", "5",
         "--max-pending-requests", "7", "--max-body-bytes", "100", "--drain-timeout", "0"]
    )  # fmt: skip
    assert config_from_args(args, env={API_KEY_ENV: " sk-env "}) == GatewayConfig(
        request_timeout_s=5.0, max_pending_requests=7, max_body_bytes=100, drain_timeout_s=0.0,
        api_keys=("sk-cli", "sk-file-1", "sk-file-2", "sk-env"),
    )  # fmt: skip
    assert config_from_args(parser.parse_args([]), env={}) == GatewayConfig(
        request_timeout_s=600.0, max_pending_requests=1024, max_body_bytes=8 * 1024 * 1024,
        drain_timeout_s=30.0, api_keys=(),
    )  # fmt: skip
    assert (GatewayConfig().timeout_s, GatewayConfig(request_timeout_s=0).timeout_s) == (600, None)
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    for argv, message in [
        (["--api-key-file", str(empty)], f"the API key file {empty} has no key"),
        (["--api-key-file", str(tmp_path / "none")], "cannot read the API key file"),
        (["--request-timeout", "-1"], "request timeout must be >= 0 s, got -1.0"),
        (["--max-pending-requests", "0"], "max pending requests must be >= 1, got 0"),
        (["--max-body-bytes", "0"], "max body bytes must be >= 1, got 0"),
        (["--drain-timeout", "nan"], "drain timeout must be >= 0 s, got nan"),
        (["--api-key", "two words"], "an API key must be non-empty printable text"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            config_from_args(parser.parse_args(argv), env={})


def test_run_gateway_refuses_a_bad_config(caplog: pytest.LogCaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_gateway_args(parser)
    args = parser.parse_args(["--coordinator", "tcp://127.0.0.1:1", "--max-pending-requests", "0"])
    assert run_gateway(args) == 2
    assert "max pending requests must be >= 1, got 0" in caplog.text
