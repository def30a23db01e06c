"""The patterns a workload spec (sim/workload.py) adds to its stream: ``Burst`` (k requests at
once every T seconds), ``MultiTurn`` (conversations re-sending their history),
``SharedPrefix`` (prompts opening with one of g shared prefixes) and ``TierShare``."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from pdserve.sim.lengths import (
    MAX_TOKENS,
    Dist,
    SpecError,
    check_dist,
    check_int,
    check_number,
)
from pdserve.sim.trace import MAX_REQUESTS

MAX_DURATION_S = 1e5
MAX_TURNS = 1000
MAX_GROUPS = 1_000_000
MAX_TIER = 1000


@dataclass(frozen=True)
class Burst:
    """``size`` requests at once every ``every_s`` seconds (kind ``burst``)."""

    every_s: float
    size: int
    prompt: Dist
    output: Dist
    start_s: float | None = None  # None: bench's times, every_s, 2·every_s, ...

    def __post_init__(self) -> None:
        check_number(self.every_s, "every_s", MAX_DURATION_S)
        check_int(self.size, "size", 1, MAX_REQUESTS)
        check_dist(self.prompt, "prompt")
        check_dist(self.output, "output")
        if self.start_s is not None:
            check_number(self.start_s, "start_s", MAX_DURATION_S, open_low=False)

    def count(self, horizon_s: float) -> int:
        if self.start_s is None:  # bench/datasets.py burst_times: at least one
            return max(1, int(horizon_s // self.every_s))
        return max(0, math.ceil((horizon_s - self.start_s) / self.every_s))

    def times(self, horizon_s: float) -> list[float]:
        """Bench's ``burst_times`` (every_s·k for k = 1 .. max(1, horizon // every_s)) without
        ``start_s``; with it, start_s + every_s·k below the horizon."""
        if self.start_s is None:
            return [self.every_s * (k + 1) for k in range(self.count(horizon_s))]
        times = (self.start_s + self.every_s * k for k in range(self.count(horizon_s)))
        return [t for t in times if t < horizon_s]

    def describe(self) -> str:
        start = "" if self.start_s is None else f" from {self.start_s:g} s"
        return (
            f"bursts of {self.size} every {self.every_s:g} s{start} (prompt "
            f"{self.prompt.describe()}, output {self.output.describe()})"
        )


@dataclass(frozen=True)
class MultiTurn:
    """``conversations`` chats of ``turns`` turns (bench/multi_turn.py); turn k's prompt is the
    system prompt, every earlier user message and answer, and its own user message.
    Conversation c's turn k is cached as ``conv{c}/t{k}`` and names ``sys`` (when
    ``shared_system``) and turn k−1 as its prefixes.

    Open loop: the bench sends turn k+1 once turn k's answer is back (and ``think_s`` later),
    which only the simulation knows. Here it arrives ``turn_gap_s + think_s`` after turn k
    did, ``turn_gap_s`` an estimate of a turn's latency, however the simulated cluster fares:
    a cluster slower than the estimate gets turns sooner than the bench would send them (and
    may not hold turn k's KV yet); a closed loop would need the simulator. ``concurrency``
    (bench's ``--max-concurrency``) holds a slot for a conversation's estimated span: the
    next conversation starts when the earliest slot frees."""

    conversations: int
    turns: int
    user: Dist
    output: Dist
    turn_gap_s: float  # estimated: a turn's arrival to its answer (the simulator's TTFT + decode)
    system_tokens: int = 0
    shared_system: bool = True  # one system prompt for all (bench's), else one per conversation
    think_s: float = 0.0
    concurrency: int | None = None  # conversations in flight at once; None: no bound

    def __post_init__(self) -> None:
        check_int(self.conversations, "conversations", 1, MAX_REQUESTS)
        check_int(self.turns, "turns", 1, MAX_TURNS)
        check_dist(self.user, "user")
        check_dist(self.output, "output")
        check_number(self.turn_gap_s, "turn_gap_s", MAX_DURATION_S, open_low=False)
        check_int(self.system_tokens, "system_tokens", 0, MAX_TOKENS)
        if not isinstance(self.shared_system, bool):
            raise SpecError("shared_system", f"must be true or false, got {self.shared_system!r}")
        check_number(self.think_s, "think_s", MAX_DURATION_S, open_low=False)
        if self.concurrency is not None:
            check_int(self.concurrency, "concurrency", 1, MAX_REQUESTS)
        longest = self.system_tokens + self.turns * self.user.largest()
        longest += (self.turns - 1) * self.output.largest()
        if longest > MAX_TOKENS:
            raise SpecError("turns", f"the last turn's prompt may reach {longest} tokens")

    def span_s(self) -> float:
        """A conversation's estimated time in flight: first turn's arrival to last answer."""
        return self.turns * self.turn_gap_s + (self.turns - 1) * self.think_s

    def starts(self, arrivals: list[float]) -> list[float]:
        """Each conversation's start: its arrival, or once a slot frees (arrival order)."""
        if self.concurrency is None:
            return arrivals
        free = [0.0] * self.concurrency  # when each slot frees
        starts = []
        for at in arrivals:
            start = max(at, heapq.heappop(free))
            heapq.heappush(free, start + self.span_s())
            starts.append(start)
        return starts

    def mean_prompt(self) -> float:
        n = self.turns
        u, o = self.user.expected(), self.output.expected()
        return self.system_tokens + u * (n + 1) / 2 + o * (n - 1) / 2

    def describe(self, rate: float) -> str:
        system = f"{'shared ' if self.shared_system else ''}system {self.system_tokens}, "
        bound = f", {self.concurrency} at a time" if self.concurrency else ""
        return (
            f"{self.conversations} conversations × {self.turns} turns at {rate:g}/s{bound} "
            f"({system}user {self.user.describe()}, output {self.output.describe()}, turn gap "
            f"{self.turn_gap_s:g} s, think {self.think_s:g} s)"
        )


@dataclass(frozen=True)
class SharedPrefix:
    """Each stream request's prompt opens with one of ``groups`` prefixes of ``tokens``
    tokens (``group{i}``), the groups equally used in a random order (bench's shared-prefix
    dataset); ``prompt`` draws the rest."""

    groups: int
    tokens: int

    def __post_init__(self) -> None:
        check_int(self.groups, "groups", 1, MAX_GROUPS)
        check_int(self.tokens, "tokens", 1, MAX_TOKENS)


@dataclass(frozen=True)
class TierShare:
    tier: int
    share: float

    def __post_init__(self) -> None:
        check_int(self.tier, "tier", 0, MAX_TIER)
        check_number(self.share, "share", 1.0)
