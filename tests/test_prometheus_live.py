"""A real Prometheus (Debian's) scraping a served tiny cluster: after traffic (one tenant held to
its limit, so a 429 too), every query of the Grafana dashboard, every metric the alert and
recording rules name, every recording rule and the KEDA queries return data through its HTTP
API, so none names a metric pdserve does not export or a label it does not set."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from pdserve.runtime.sockets import free_port
from tests.e2e_util import PDSERVE, ServedCluster
from tests.gateway_util import wait_until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
TENANTS = """[tenants.small]
requests_per_minute = 2
tokens_per_minute = 100000
keys = []

[tenants.big]
keys = []
"""


@pytest.fixture(scope="module")
def served(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedCluster]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS, encoding="utf-8")
    keys = {
        name: subprocess.run(
            [*PDSERVE, "keys", "add", name, f"--tenants={tenants}"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()
        for name in ("small", "big")
    }  # fmt: skip
    c = ServedCluster(tiny_dir, f"--tenants={tenants}", "--num-kv-blocks=256")
    c.keys = keys  # type: ignore[attr-defined]
    yield c
    c.stop()


@pytest.fixture(scope="module")
def prometheus(served: ServedCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Prometheus on a free port scraping the gateway each second, the rules loaded with their
    groups evaluated each second; its URL once the target is up."""
    binary = shutil.which("prometheus")
    assert binary is not None, "prometheus is missing: `make test` installs Debian's"
    work = tmp_path_factory.mktemp("prometheus")
    rules = yaml.safe_load((DEPLOY / "prometheus" / "pdserve-rules.yml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    (work / "rules.yml").write_text(yaml.safe_dump(rules))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(work / "rules.yml")],
        "scrape_configs": [
            {
                "job_name": "pdserve",
                "static_configs": [{"targets": [served.url.removeprefix("http://")]}],
            }
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(url), 60, "prometheus scraping the gateway")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _up(url: str) -> bool:
    try:
        return bool(query(url, 'up{job="pdserve"} == 1'))
    except (httpx.HTTPError, AssertionError):
        return False


def query(url: str, expr: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=30)
    # a Prometheus still starting answers 503 "Service Unavailable", not JSON
    assert r.status_code == 200, (expr, r.status_code, r.text[:200])
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def traffic(served: ServedCluster) -> None:
    """Requests of every kind the panels count: plain, streamed, refused (404), and the small
    tenant's three against its two a minute (one 429)."""
    url, model = served.url, served.model_name
    small, big = ({"Authorization": f"Bearer {served.keys[t]}"} for t in ("small", "big"))  # type: ignore[attr-defined]
    statuses = []
    for i in range(3):
        body = {"model": model, "prompt": f"hello {i}", "max_tokens": 8, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=small, timeout=60)
        statuses.append(r.status_code)
    assert statuses == [200, 200, 429]
    body = {"model": model, "prompt": "stream", "max_tokens": 8, "stream": True}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=big, timeout=60)
    assert r.status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=big)
    assert r.status_code == 404


def test_every_dashboard_rule_and_keda_query_returns_data(served, prometheus) -> None:
    traffic(served)
    dashboard = json.loads((DEPLOY / "grafana" / "pdserve-dashboard.json").read_text())
    panels = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    exprs = [(title, e.replace("$__rate_interval", "1m")) for title, e in panels]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "pdserve-rules.yml").read_text())
    named = {
        n
        for g in rules["groups"]
        for r in g["rules"]
        for n in re.findall(r"\bpdserve_[a-z0-9_]+", r["expr"])
    }
    exprs += [(f"rule metric {n}", n) for n in sorted(named)]
    exprs += [
        (f"recording rule {r['record']}", r["record"])
        for g in rules["groups"]
        for r in g["rules"]
        if "record" in r
    ]
    keda = (DEPLOY / "kubernetes" / "components" / "keda" / "scaledobjects.yaml").read_text()
    for q in re.findall(r"query: (.+)", keda):  # the model the manifests name, here the tiny one
        exprs.append(("keda", re.sub(r'model="[^"]+"', f'model="{served.model_name}"', q)))
    missing: list[str] = []
    deadline = time.monotonic() + 60  # scrapes each second, the planner plans every 5 s
    while True:
        missing = [f"{title}: {e}" for title, e in exprs if not query(prometheus, e)]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not missing, "\n".join(missing)
    assert len(panels) >= 16
