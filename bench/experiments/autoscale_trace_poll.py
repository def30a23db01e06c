"""What a cluster of the autoscale trace benchmark (``autoscale_trace.py``) is doing, read off
its gateway: live workers per role (the ``pdserve_kv_blocks_total`` series of ``/metrics``,
draining workers included: they hold a core until they exit) and the planner's plan
(``GET /planner``). ``Poller`` samples them once a second during a run; ``settle`` waits
before one until the cluster is back at its starting size."""

from __future__ import annotations

import re
import threading
import time
from typing import Any  # a sample is JSON: figures and labels, read by key

import httpx

from pdserve.launch.plan_source import parse_plan

LIVE = re.compile(r'^pdserve_kv_blocks_total\{[^}]*role="(prefill|decode)"[^}]*\} ', re.M)


def read(client: httpx.Client, url: str, model: str) -> dict[str, Any]:
    """``live_prefill``, ``live_decode`` (absent if /metrics did not answer) and the plan:
    ``desired_prefill``, ``desired_decode``, ``max_local_prefill_tokens``, ``reason`` (absent
    if there is none for ``model``)."""
    sample: dict[str, Any] = {}
    try:
        roles = LIVE.findall(client.get(f"{url}/metrics").text)
        sample |= {f"live_{r}": roles.count(r) for r in ("prefill", "decode")}
    except httpx.HTTPError:
        pass
    try:
        doc = client.get(f"{url}/planner").json()
    except (httpx.HTTPError, ValueError):
        return sample
    plan = parse_plan(doc, model)
    if plan is None:
        return sample
    entry = next(e for e in doc["models"] if e.get("model") == model)
    return sample | {
        "desired_prefill": plan.prefill,
        "desired_decode": plan.decode,
        "max_local_prefill_tokens": entry.get("max_local_prefill_tokens"),
        "reason": plan.reason,
    }


class Poller(threading.Thread):
    """Once a second until stopped: ``read``'s figures as ``samples``, each with ``t`` in
    seconds from ``t0`` (``time.perf_counter``); a gap in the counts is held by the last."""

    def __init__(self, url: str, model: str, t0: float, period_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.t0, self.period_s = url, model, t0, period_s
        self.samples: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        reason = None  # kept only where it changes: the samples stay small
        with httpx.Client(timeout=5) as client:
            while not self.halt.is_set():
                sample = {"t": round(time.perf_counter() - self.t0, 3)}
                sample |= read(client, self.url, self.model)
                if sample.get("reason") == reason:
                    sample.pop("reason", None)
                reason = sample.get("reason", reason)
                self.samples.append(sample)
                self.halt.wait(self.period_s)

    def stop(self) -> list[dict[str, Any]]:
        """The samples where anything changed, and the last: each holds until the next."""
        self.halt.set()
        self.join()
        return changes(self.samples)


def changes(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``samples`` less those that repeat the one before but for ``t`` (the last is kept)."""
    kept = []
    for k, sample in enumerate(samples):
        figures = {key: v for key, v in sample.items() if key != "t"}
        before = {key: v for key, v in samples[k - 1].items() if key != "t"} if k else None
        if figures != before or k == len(samples) - 1:
            kept.append(sample)
    return kept


def settle(url: str, model: str, at_least_s: float, at_most_s: float) -> dict[str, Any]:
    """Waits ``at_least_s`` (the warm-up's samples leave the planner's window), then until the
    plan and the live workers are one prefill and one decode worker, up to ``at_most_s`` in
    all. The last reading, with ``waited_s``."""
    start = time.monotonic()
    time.sleep(at_least_s)
    start_size = {"prefill": 1, "decode": 1}
    with httpx.Client(timeout=5) as client:
        while True:
            now = read(client, url, model)
            done = all(
                now.get(f"{kind}_{role}") == n
                for role, n in start_size.items()
                for kind in ("live", "desired")
            )
            waited = time.monotonic() - start
            if done or waited >= at_most_s:
                return now | {"waited_s": waited}
            time.sleep(1.0)
