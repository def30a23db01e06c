"""The gateway's part in planning: the latency samples it sends the coordinator in each hello
(``LatencySampler``), and the coordinator's plans as it shows them (``PlannerMetrics`` on
``/metrics``, ``planner_json`` at ``GET /planner``)."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import Any

from pdserve.gateway.observe.prometheus import Gauge, Registry
from pdserve.protocol.planning import MAX_SAMPLES, LatencySamples, PlanReport


class _Buffer:
    def __init__(self) -> None:
        self.ttft: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.tpot: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.output: deque[int] = deque(maxlen=MAX_SAMPLES)
        self.requests = 0
        self.errors = 0


class LatencySampler:
    """Each model's samples since the last hello, at most ``MAX_SAMPLES`` of each (the oldest
    go first), and each model's requests ended and failed (the canary gate's); bounded in
    models too: a model name reaches here only once a request for it was admitted (or refused
    after its name was found: a served model, a rollout's version), and the buffers empty at
    every hello."""

    def __init__(self) -> None:
        self._models: dict[str, _Buffer] = {}

    def first_token(self, model: str, ttft_s: float) -> None:
        self._buffer(model).ttft.append(ttft_s)

    def choice_ended(self, model: str, tokens: int, decode_s: float) -> None:
        """A choice finished with ``tokens`` tokens, ``decode_s`` from its first to its last."""
        buffer = self._buffer(model)
        buffer.output.append(tokens)
        if tokens > 1:
            buffer.tpot.append(decode_s / (tokens - 1))

    def request_ended(self, model: str, failed: bool) -> None:
        """A request ended, or was refused before it ran; ``failed``: by the server's fault."""
        buffer = self._buffer(model)
        buffer.requests += 1
        buffer.errors += failed

    def drain(self) -> list[LatencySamples]:
        """Every model's samples, emptied."""
        models, self._models = self._models, {}
        return [
            LatencySamples(
                model=name,
                ttft_s=list(b.ttft),
                tpot_s=list(b.tpot),
                output_tokens=list(b.output),
                requests=b.requests,
                errors=b.errors,
            )
            for name, b in sorted(models.items())
        ]

    def _buffer(self, model: str) -> _Buffer:
        if model not in self._models:
            self._models[model] = _Buffer()
        return self._models[model]


class PlannerMetrics:
    """The coordinator's plans, as it last reported them: replaced wholesale at each render."""

    def __init__(self, r: Registry) -> None:
        self.desired = r.add(
            Gauge(
                "pdserve_planner_desired_workers",
                "Workers the planner wants per model and role (prefill, decode).",
                ["model", "role"],
            )
        )
        self.local_tokens = r.add(
            Gauge(
                "pdserve_planner_max_local_prefill_tokens",
                "Largest uncached prompt a decode worker prefills itself, as the planner set it.",
                ["model"],
            )
        )
        self.inputs = r.add(
            Gauge(
                "pdserve_planner_input",
                "The figures the planner's last plan read (its Load), by name.",
                ["model", "input"],
            )
        )

    def set(self, plans: list[PlanReport]) -> None:
        for metric in (self.desired, self.local_tokens, self.inputs):
            metric.clear()
        for p in plans:
            self.desired.set(p.prefill, model=p.model, role="prefill")
            self.desired.set(p.decode, model=p.model, role="decode")
            self.local_tokens.set(p.max_local_prefill_tokens, model=p.model)
            for name, value in sorted(p.load.items()):
                if value is not None:
                    self.inputs.set(value, model=p.model, input=name)


def planner_json(plans: list[PlanReport]) -> dict[str, Any]:
    """``GET /planner``: each model's plan and the figures it read."""
    return {"models": [asdict(p) for p in plans]}
