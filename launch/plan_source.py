"""What ``pdserve serve --autoscale`` reads from its gateway: the planner's plan for the served
model (``GET /planner``) and the requests on each worker (``GET /metrics``), both checked and
bounded; a gateway that does not answer (starting, restarting) gives no plan and no loads.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass

ROLES = ("prefill", "decode")
MAX_COUNT = 4096  # workers one plan may ask for per role: more than any machine runs
MAX_REASON = 300  # characters of the plan's reason kept for the log
MAX_BODY = 1 << 20  # bytes read of /planner or /metrics


@dataclass(frozen=True)
class Desired:
    """The workers the planner wants for the served model, and why."""

    prefill: int
    decode: int
    reason: str = ""

    def of(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode


def parse_plan(doc: object, model: str) -> Desired | None:
    """``model``'s entry of a ``GET /planner`` answer; None if it has none or it is malformed."""
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list):
        return None
    for entry in doc["models"][:MAX_COUNT]:
        if not isinstance(entry, dict) or entry.get("model") != model:
            continue
        counts = [entry.get(role) for role in ROLES]
        fit = [n for n in counts if type(n) is int and 0 <= n <= MAX_COUNT]  # bool is no count
        if len(fit) != len(ROLES):
            return None
        reason = entry.get("reason")
        reason = reason[:MAX_REASON] if isinstance(reason, str) else ""
        return Desired(prefill=fit[0], decode=fit[1], reason=reason)
    return None


def worker_loads(metrics: str) -> dict[str, int]:
    """Requests running and waiting per worker id, from the gateway's ``/metrics`` text."""
    loads: dict[str, int] = {}
    pattern = r'^pdserve_requests_(?:running|waiting)\{[^}]*worker="([^"]+)"[^}]*\} (\S+)$'
    for worker, value in re.findall(pattern, metrics, re.MULTILINE):
        try:
            loads[worker] = loads.get(worker, 0) + int(float(value))
        except (ValueError, OverflowError):
            continue
    return loads


def planner_source(url: str, model: str) -> Callable[[], Desired | None]:
    """Reads ``model``'s plan from the gateway at ``url`` (None while it does not answer)."""

    def read() -> Desired | None:
        try:
            return parse_plan(json.loads(_get(f"{url}/planner")), model)
        except (OSError, ValueError):
            return None

    return read


def metrics_source(url: str) -> Callable[[], Mapping[str, int]]:
    """Requests per worker from the gateway at ``url`` (empty while it does not answer)."""

    def read() -> Mapping[str, int]:
        try:
            return worker_loads(_get(f"{url}/metrics"))
        except (OSError, ValueError):
            return {}

    return read


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as r:
        body: bytes = r.read(MAX_BODY)
        return body.decode()
