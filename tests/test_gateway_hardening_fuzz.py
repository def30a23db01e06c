"""schemathesis against the gateway's served OpenAPI schema: positive and negative bodies for
both generation endpoints, a fixed seed, zero 5xx, every refusal an OpenAI error body. The fake
backend (a test double for the ZMQ client) answers whatever gets through."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.app import create_app
from tests.gateway_util import FakeBackend, Script, running_server, served_model

MAX_EXAMPLES = 60  # per operation and generation mode


@pytest.fixture(scope="module")
def roomy_url(tok: Tokenizer) -> Iterator[str]:
    """A server whose model has room for the long prompts the fuzzer writes."""
    backend = FakeBackend([served_model("tiny", 4096)], Script([[5, 6, 7]]))
    with running_server(create_app(backend, {"tiny": tok})) as url:
        yield url


def fuzz(url: str, path: str, max_examples: int) -> Counter[int]:
    """Positive and negative bodies for ``path`` from the served OpenAPI schema, with a fixed
    seed, most naming the served model "tiny" (a random name stops at the 404): no 5xx, every
    refusal an OpenAI error body. The statuses seen, counted."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operation = schema[path]["POST"]
    modes = [operation.as_strategy(m) for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    statuses: Counter[int] = Counter()
    session = requests.Session()

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(modes), served_model=st.sampled_from([True, True, True, False]))
    def check(case: Any, served_model: bool) -> None:
        if served_model and isinstance(case.body, dict):
            case.body["model"] = "tiny"
        response = case.call(base_url=url, session=session, timeout=30)
        statuses[response.status_code] += 1
        assert response.status_code < 500, f"{case.body!r} -> {response.text}"
        if response.status_code != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text

    check()
    return statuses


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_schemathesis_finds_no_5xx(roomy_url: str, path: str) -> None:
    statuses = fuzz(roomy_url, path, 2 * MAX_EXAMPLES)
    # The bodies were meaningful: many reached the backend, many were refused. (Which of them
    # name another model varies with the schema's shape: the 404 is asked for below.)
    assert statuses[200] >= 20 and statuses[400] >= 20, statuses
    assert set(statuses) <= {200, 400, 404, 415}, statuses
    body = {"model": "not-served", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    assert httpx.post(f"{roomy_url}{path}", json=body).status_code == 404
    assert httpx.get(f"{roomy_url}/health").status_code == 200
