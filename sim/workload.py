"""Reading a workload: a JSON spec file, a compact string, or a trace (sim/trace.py), into a
``Workload``: a ``WorkloadSpec`` (sim/spec.py) or a ``Trace``, both of which say their
requests, describe themselves, scale to a slice and give the planner its means.

A JSON spec (every field checked; an error names its path, ``workload.prompt.mean: ...``)::

    {"rate": 20, "duration_s": 60, "burstiness": 0.5,
     "prompt": {"dist": "lognormal", "mean": 512, "sigma": 1.0, "max": 4096},
     "output": {"dist": "uniform", "low": 32, "high": 128},
     "bursts": [{"every_s": 5, "size": 4, "prompt": 1024, "output": 16}],
     "shared_prefix": {"groups": 8, "tokens": 256},
     "tiers": [{"tier": 0, "share": 0.2}, {"tier": 1, "share": 0.8}],
     "seed": 0}

``requests`` (a count) may stand for ``duration_s``; a length is ``{"dist": "fixed", "value":
N}``, ``{"dist": "uniform", "low": A, "high": B}``, ``{"dist": "lognormal", "mean": M,
"sigma": S, "max": CAP}``, or the compact form below (a plain integer is fixed). A burst may
name ``start_s``. Multi-turn (instead of ``prompt``, ``output`` and ``requests``; see
sim/patterns.py ``MultiTurn``)::

    {"rate": 1e6, "multi_turn": {"conversations": 16, "turns": 4, "system_tokens": 256,
     "shared_system": true, "user": 64, "output": 32, "think_s": 0, "turn_gap_s": 3.0,
     "concurrency": 8}}

That is about the bench's kv_routing run (bench/results/kv_routing_*.json: all 16 at once, 8
at a time): open loop, each turn ``turn_gap_s + think_s`` after the last (an estimate of a
turn's latency: only a simulation knows when an answer is back).

The compact string (``pdserve plan --workload``): ``key=value`` pairs joined by commas::

    rate=5000,duration=20,prompt=3000,output=400
    rate=2,requests=500,prompt=lognormal:512:1.0:4096,output=uniform:32:128,burstiness=0.5

keys ``rate``, ``duration`` (or ``duration_s``), ``requests``, ``burstiness``, ``seed``,
``prompt``, ``output``; a length is ``N`` (fixed), ``uniform:LOW:HIGH`` or
``lognormal:MEAN:SIGMA:MAX``. Anything more goes in a JSON file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol  # a spec read from JSON: values of every type until checked

from pdserve.sim.lengths import SpecError, at, check_keys, number, parse_dist
from pdserve.sim.patterns import Burst, MultiTurn, SharedPrefix, TierShare
from pdserve.sim.request import SimRequest
from pdserve.sim.spec import WorkloadSpec
from pdserve.sim.trace import Trace, bench_trace, read_csv_trace, read_text

__all__ = ["Trace", "Workload", "WorkloadSpec", "load_workload", "parse_compact", "spec_from_json"]

OPTIONAL = (
    "duration_s",
    "requests",
    "burstiness",
    "prompt",
    "output",
    "bursts",
    "multi_turn",
    "shared_prefix",
    "tiers",
    "seed",
)
COMPACT = {
    "rate": "rate",
    "duration": "duration_s",
    "duration_s": "duration_s",
    "requests": "requests",
    "burstiness": "burstiness",
    "seed": "seed",
    "prompt": "prompt",
    "output": "output",
}


class Workload(Protocol):
    """What the simulator and the planner take: a ``WorkloadSpec`` or a ``Trace``."""

    def requests(self, seed: int | None = None) -> list[SimRequest]: ...
    def describe(self) -> str: ...
    def scaled(self, fraction: float) -> Workload: ...
    def mean_prompt_tokens(self) -> float: ...
    def mean_output_tokens(self) -> float: ...
    def request_rate(self) -> float: ...


def load_workload(text: str) -> Workload:
    """``FILE.csv``: a trace; ``FILE.json``: a spec, or a ``pdserve bench --save-detailed``
    result (a sweep's run by ``FILE.json#N``, from 0); otherwise a compact string."""
    text = text.strip()
    path, _, run = text.partition("#")
    if path.lower().endswith((".csv", ".json")):
        if not os.path.isfile(path):
            raise ValueError(f"workload: no such file {path!r}")
        if path.lower().endswith(".csv"):
            return read_csv_trace(path)
        try:
            data = json.loads(read_text(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg}, line {e.lineno})") from None
        return _from_json_file(data, path, run)
    return parse_compact(text)


def _from_json_file(data: Any, path: str, run: str) -> Workload:
    if isinstance(data, dict) and "rows" in data:  # a sweep: one row per rate
        rows = data["rows"]
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{path}: rows must be a non-empty list of bench results")
        if not run and len(rows) > 1:
            raise ValueError(f"{path}: a sweep of {len(rows)} runs: pick one, {path}#N")
        index = int(run) if run.isdigit() else -1 if run else 0
        if not 0 <= index < len(rows) or not isinstance(rows[index], dict):
            raise ValueError(f"{path}: no run {run!r} (0 to {len(rows) - 1})")
        return bench_trace(rows[index], f"{path}#{index}")
    if run:
        raise ValueError(f"{path}: #{run} picks a sweep's run; this is not a sweep")
    if isinstance(data, dict) and "input_lens" in data:
        return bench_trace(data, path)
    return spec_from_json(data)


def spec_from_json(data: Any) -> WorkloadSpec:
    with at("workload"):
        if not isinstance(data, dict):
            raise SpecError("", f"must be a JSON object, got {type(data).__name__}")
        check_keys(data, required=("rate",), optional=OPTIONAL)
        fields = {k: data[k] for k in ("rate", "duration_s", "burstiness", "seed") if k in data}
        fields["num_requests"] = data.get("requests")
        for name in ("prompt", "output"):
            if data.get(name) is not None:
                with at(name):
                    fields[name] = parse_dist(data[name])
        fields["bursts"] = tuple(_burst(b) for b in _items(data, "bursts"))
        fields["tiers"] = tuple(_tier(t) for t in _items(data, "tiers"))
        if data.get("multi_turn") is not None:
            with at("multi_turn"):
                fields["multi_turn"] = _multi_turn(data["multi_turn"])
        if data.get("shared_prefix") is not None:
            with at("shared_prefix"):
                value = _object(data["shared_prefix"])
                check_keys(value, required=("groups", "tokens"))
                fields["shared_prefix"] = SharedPrefix(**value)
        return WorkloadSpec(**fields)


def parse_compact(text: str) -> WorkloadSpec:
    data: dict[str, Any] = {}
    keys = ", ".join(COMPACT)
    with at("workload"):
        for item in text.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not key and not value:
                continue
            if not sep:
                raise SpecError("", f"{item.strip()!r} is not key=value")
            if key not in COMPACT:
                more = "anything more goes in a JSON file"
                raise SpecError(key, f"unknown key (compact keys: {keys}; {more})")
            if COMPACT[key] in data:
                raise SpecError(key, "given twice")
            data[COMPACT[key]] = value if key in ("prompt", "output") else number(value)
    return spec_from_json(data)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError("", f"must be an object, got {value!r}")
    return value


def _items(data: dict[str, Any], name: str) -> list[tuple[str, dict[str, Any]]]:
    """A list field's objects, each with its path (``bursts[2]``)."""
    value = data.get(name) or []
    if not isinstance(value, list):
        raise SpecError(name, f"must be a list, got {value!r}")
    out = []
    for i, item in enumerate(value):
        with at(f"{name}[{i}]"):
            out.append((f"{name}[{i}]", _object(item)))
    return out


def _burst(item: tuple[str, dict[str, Any]]) -> Burst:
    path, value = item
    with at(path):
        check_keys(value, required=("every_s", "size", "prompt", "output"), optional=("start_s",))
        with at("prompt"):
            prompt = parse_dist(value["prompt"])
        with at("output"):
            output = parse_dist(value["output"])
        return Burst(value["every_s"], value["size"], prompt, output, value.get("start_s"))


def _tier(item: tuple[str, dict[str, Any]]) -> TierShare:
    path, value = item
    with at(path):
        check_keys(value, required=("tier", "share"))
        return TierShare(**value)


def _multi_turn(data: Any) -> MultiTurn:
    value = _object(data)
    optional = ("system_tokens", "shared_system", "think_s", "concurrency")
    check_keys(
        value,
        required=("conversations", "turns", "user", "output", "turn_gap_s"),
        optional=optional,
    )
    fields = dict(value)
    for name in ("user", "output"):
        with at(name):
            fields[name] = parse_dist(value[name])
    return MultiTurn(**fields)
