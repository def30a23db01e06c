"""Workloads: the list of requests a run sends.

- ``random``: prompts of ``input_len`` tokens, outputs of ``output_len``; with a range ratio r
  each length is uniform in [len·(1−r), len·(1+r)] (vLLM's random dataset).
- ``shared-prefix``: ``groups`` system prompts of ``prefix_len`` tokens, each shared by its
  group's requests (a random suffix each); the requests are shuffled.
- ``mixed``: the interference workload disaggregation exists for — a steady population of
  short-prompt, long-output streams arriving at the request rate, plus every ``burst_interval``
  seconds a burst of ``burst_size`` long-prompt, short-output requests at fixed times::

      streams  ─s──s─s───s──s─s──s───s─s──s─   (Poisson, --request-rate)
      bursts   ────────BBBB────────BBBB─────   (every --mixed-burst-interval s)

- ``jsonl``: one ``{"prompt": str | "messages": [...], "max_tokens": int}`` object per line.
- ``multi-turn``: chat conversations re-sending their history (``bench/multi_turn.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any  # jsonl rows and chat messages: JSON, values of every type

import numpy as np

from pdserve.bench.prompts import PromptMaker


@dataclass(frozen=True)
class BenchRequest:
    prompt: str  # the user text (completions: sent after ``system``)
    max_tokens: int
    prompt_len: int  # the workload's own token count, used where the server reports none
    system: str = ""  # a shared prefix: the chat system message / the completion's start
    messages: tuple[dict[str, Any], ...] | None = None  # a jsonl conversation, sent as is
    kind: str = ""
    at: float | None = None  # a fixed send time, s from the start; None: the arrival process
    turn: int = 0  # a multi-turn conversation's turn, from 1; 0: not one


@dataclass(frozen=True)
class MixedSpec:
    stream_input_len: int = 32
    stream_output_len: int = 256
    burst_input_len: int = 1024
    burst_output_len: int = 16
    burst_size: int = 4
    burst_interval: float = 5.0


def lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> list[int]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    drawn: list[int] = rng.integers(low, high + 1, size=n).tolist()  # tolist() is untyped
    return drawn


def random_requests(
    maker: PromptMaker,
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rng: np.random.Generator,
) -> list[BenchRequest]:
    ins = lengths(rng, n, input_len, range_ratio)
    outs = lengths(rng, n, output_len, range_ratio)
    return [BenchRequest(maker.text(i, rng), o, i) for i, o in zip(ins, outs, strict=True)]


def shared_prefix_requests(
    maker: PromptMaker,
    n: int,
    groups: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    rng: np.random.Generator,
) -> list[BenchRequest]:
    if groups < 1:
        raise ValueError(f"shared-prefix needs at least one group, got {groups}")
    prefixes = [maker.text(prefix_len, rng) for _ in range(groups)]
    suffixes = random_requests(maker, n, input_len, output_len, range_ratio, rng)
    requests = [
        BenchRequest(r.prompt, r.max_tokens, prefix_len + r.prompt_len, prefixes[i % groups])
        for i, r in enumerate(suffixes)
    ]
    return [requests[i] for i in rng.permutation(n)]


def burst_times(spec: MixedSpec, horizon_s: float) -> list[float]:
    """Bursts every interval while streams arrive (``horizon_s``); at least one."""
    if spec.burst_interval <= 0:
        raise ValueError(f"burst interval must be positive, got {spec.burst_interval}")
    count = max(1, int(horizon_s // spec.burst_interval))
    return [spec.burst_interval * (k + 1) for k in range(count)]


def mixed_requests(
    maker: PromptMaker,
    num_streams: int,
    spec: MixedSpec,
    horizon_s: float,
    rng: np.random.Generator,
) -> list[BenchRequest]:
    """``num_streams`` streams (arrival times from the run's arrival process) and the bursts
    (fixed times) that fall within ``horizon_s``, the streams' expected arrival span."""
    streams = [
        BenchRequest(
            maker.text(spec.stream_input_len, rng),
            spec.stream_output_len,
            spec.stream_input_len,
            kind="stream",
        )
        for _ in range(num_streams)
    ]
    bursts = [
        BenchRequest(
            maker.text(spec.burst_input_len, rng),
            spec.burst_output_len,
            spec.burst_input_len,
            kind="burst",
            at=t,
        )
        for t in burst_times(spec, horizon_s)
        for _ in range(spec.burst_size)
    ]
    return streams + bursts


def jsonl_requests(
    path: str | Path, default_max_tokens: int, maker: PromptMaker | None = None
) -> list[BenchRequest]:
    requests = []
    # lines end at "\n" only (JSON Lines): a raw U+2028 inside a string is not a line break
    for lineno, line in enumerate(Path(path).read_text().split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        requests.append(_jsonl_request(row, f"{path}:{lineno}", default_max_tokens, maker))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def _jsonl_request(
    row: Any, where: str, default_max_tokens: int, maker: PromptMaker | None
) -> BenchRequest:
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise ValueError(f"{where}: expected an object with exactly one of prompt, messages")
    max_tokens = row.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"{where}: max_tokens must be a positive integer")
    if "prompt" in row:
        if not isinstance(row["prompt"], str):
            raise ValueError(f"{where}: prompt must be a string")
        return BenchRequest(row["prompt"], max_tokens, maker.count(row["prompt"]) if maker else 0)
    messages = row["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(f"{where}: messages must be a list of objects with string content")
    count = sum(maker.count(m["content"]) for m in messages) if maker else 0
    return BenchRequest("", max_tokens, count, messages=tuple(messages))
