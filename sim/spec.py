"""A generated workload: ``WorkloadSpec``, a stream of requests (or conversations) at a rate,
with bursts, shared prefixes and tiers, drawn into ``SimRequest``s in arrival order, the same
for the same seed. sim/workload.py reads one from JSON or a compact string.

The stream's arrivals are the bench's (bench/arrivals.py ``arrival_offsets``): gamma gaps of
shape ``burstiness`` and mean ``1 / rate`` from ``numpy.random.default_rng(seed)``, the first
at 0, so a spec sends the bench's arrival times for the same seed. Lengths and tiers come from
another stream of that seed (``default_rng([seed, 1])``). ::

    stream      ─s──s─s───s──s─s──s───s─s──s─   rate, burstiness; prompt, output
    bursts      ────────BBBB────────BBBB─────   size every every_s (bench's --dataset mixed)
    multi-turn  ─c1──c2─c3──                    conversations start at the rate's arrivals;
                 t2─────t2──t2                  turn k+1 at turn k + turn_gap_s + think_s

``scaled(f)`` is a slice of the workload for a slice of a cluster (``f`` of its replicas): the
rate, the request and conversation counts and the concurrency × f (rounded, at least 1); a
burst's size × f rounded to the nearest integer, refused when that is 0 or off by more than
10 %: pick a fraction that divides the bursts. Shared prefix groups and tiers stay as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from pdserve.sim.lengths import MAX_TOKENS, Dist, SpecError, check_dist, check_int, check_number
from pdserve.sim.patterns import MAX_DURATION_S, Burst, MultiTurn, SharedPrefix, TierShare
from pdserve.sim.request import SimRequest
from pdserve.sim.trace import MAX_REQUESTS

MAX_RATE = 1e6  # requests (or conversations) per second
MAX_BURSTINESS = 1000.0
MAX_SEED = 2**63 - 1
BURST_ROUNDING = 0.1  # scaled(): the most a burst's rounded size may differ, relative

Times = npt.NDArray[np.float64]


@dataclass(frozen=True)
class WorkloadSpec:
    """A stream at ``rate`` requests/s for ``duration_s`` seconds or ``num_requests``
    requests (JSON: ``requests``) of ``prompt`` and ``output`` tokens (kind ``stream``), plus
    ``bursts``. With ``multi_turn`` instead of the stream's lengths: its conversations start
    at ``rate``/s (with ``duration_s``, no turn arrives from then on, as in the bench)."""

    rate: float
    duration_s: float | None = None
    num_requests: int | None = None
    burstiness: float = 1.0  # the gaps' gamma shape: 1 Poisson, < 1 burstier
    prompt: Dist | None = None
    output: Dist | None = None
    bursts: tuple[Burst, ...] = ()
    multi_turn: MultiTurn | None = None
    shared_prefix: SharedPrefix | None = None
    tiers: tuple[TierShare, ...] = ()  # shares of the requests (conversations) by tier
    seed: int = 0

    def __post_init__(self) -> None:
        check_number(self.rate, "rate", MAX_RATE)
        if self.duration_s is not None:
            check_number(self.duration_s, "duration_s", MAX_DURATION_S)
        if self.num_requests is not None:
            check_int(self.num_requests, "requests", 1, MAX_REQUESTS)
        check_number(self.burstiness, "burstiness", MAX_BURSTINESS)
        check_int(self.seed, "seed", 0, MAX_SEED)
        if self.multi_turn is None:
            if (self.duration_s is None) == (self.num_requests is None):
                raise SpecError("duration_s", "give either duration_s or requests")
            for name in ("prompt", "output"):
                if getattr(self, name) is None:
                    raise SpecError(name, "required (the stream's lengths)")
                check_dist(getattr(self, name), name)
        else:
            given = {"requests": self.num_requests, "prompt": self.prompt, "output": self.output}
            for name, value in {**given, "shared_prefix": self.shared_prefix}.items():
                if value is not None:
                    raise SpecError(name, "not with multi_turn (its conversations say it)")
        if self.shared_prefix and self.prompt:
            longest = self.shared_prefix.tokens + self.prompt.largest()
            if longest > MAX_TOKENS:
                raise SpecError("shared_prefix.tokens", f"prompts may reach {longest} tokens")
        total = sum(t.share for t in self.tiers)
        if self.tiers and abs(total - 1) > 1e-6:
            raise SpecError("tiers", f"shares must sum to 1, got {total:g}")
        if len({t.tier for t in self.tiers}) != len(self.tiers):
            raise SpecError("tiers", "a tier is listed twice")
        bursts = sum(b.count(self.horizon_s()) * b.size for b in self.bursts)
        if self._stream_count() + bursts > MAX_REQUESTS:
            raise SpecError(
                "",
                f"about {self._stream_count() + bursts:.3g} requests: more than the "
                f"{MAX_REQUESTS} a run may have",
            )

    def _stream_count(self) -> float:
        """The stream's requests (the conversations' turns), expected."""
        if self.multi_turn:
            return self.multi_turn.conversations * self.multi_turn.turns
        if self.num_requests is not None:
            return self.num_requests
        return self.rate * (self.duration_s or 0.0)

    def horizon_s(self) -> float:
        """How long the stream arrives, as the bench reckons it for bursts: ``duration_s``,
        else its count (of requests or conversations) / rate."""
        if self.duration_s is not None:
            return self.duration_s
        count = self.multi_turn.conversations if self.multi_turn else self.num_requests or 0
        return count / self.rate

    def burst_times(self, burst: Burst) -> list[float]:
        """``burst.times`` within the horizon, less those from ``duration_s`` on (the bench
        sends none after its duration)."""
        end = math.inf if self.duration_s is None else self.duration_s
        return [t for t in burst.times(self.horizon_s()) if t < end]

    def requests(self, seed: int | None = None) -> list[SimRequest]:
        """Every request in arrival order (ties: stream, bursts, conversations); ``seed``
        overrides the spec's."""
        seed = self.seed if seed is None else seed
        check_int(seed, "seed", 0, MAX_SEED)
        arrivals, draws = np.random.default_rng(seed), np.random.default_rng([seed, 1])
        out: list[SimRequest] = []
        if self.multi_turn:
            starts = _offsets(self.multi_turn.conversations, self, arrivals)
            out = self._conversations(self.multi_turn, self.multi_turn.starts(starts), draws)
        elif self.prompt and self.output:
            times = _stream_arrivals(self, arrivals)
            out = self._batch(times, self.prompt, self.output, draws, "stream", self.shared_prefix)
        for burst in self.bursts:
            times = np.repeat(np.array(self.burst_times(burst)), burst.size)
            out += self._batch(times, burst.prompt, burst.output, draws, "burst")
        out.sort(key=lambda r: r.arrival_s)
        return out

    def _tiers(self, rng: np.random.Generator, n: int) -> list[int]:
        if not self.tiers:
            return [0] * n
        shares = np.array([t.share for t in self.tiers])
        tiers = np.array([t.tier for t in self.tiers])
        picked: list[int] = rng.choice(tiers, size=n, p=shares / shares.sum()).tolist()
        return picked

    def _batch(
        self,
        times: Times,
        prompt: Dist,
        output: Dist,
        rng: np.random.Generator,
        kind: str,
        shared: SharedPrefix | None = None,
    ) -> list[SimRequest]:
        n = len(times)
        prompts, outputs = prompt.sample(rng, n).tolist(), output.sample(rng, n).tolist()
        tiers = self._tiers(rng, n)
        if shared is None:
            cols = zip(times.tolist(), prompts, outputs, tiers, strict=True)
            return [SimRequest(t, p, o, tier=tier, kind=kind) for t, p, o, tier in cols]
        # bench's shared-prefix dataset: request i in group i % groups, then shuffled
        groups = (rng.permutation(n) % shared.groups).tolist()
        named = [((f"group{g}", shared.tokens),) for g in range(shared.groups)]
        cols4 = zip(times.tolist(), prompts, outputs, tiers, groups, strict=True)
        return [
            SimRequest(t, shared.tokens + p, o, prefixes=named[g], tier=tier, kind=kind)
            for t, p, o, tier, g in cols4
        ]

    def _conversations(
        self, mt: MultiTurn, starts: list[float], rng: np.random.Generator
    ) -> list[SimRequest]:
        shape = (mt.conversations, mt.turns)
        users = mt.user.sample(rng, mt.conversations * mt.turns).reshape(shape).tolist()
        outs = mt.output.sample(rng, mt.conversations * mt.turns).reshape(shape).tolist()
        tiers = self._tiers(rng, mt.conversations)
        system = (("sys", mt.system_tokens),) if mt.shared_system and mt.system_tokens else ()
        end = math.inf if self.duration_s is None else self.duration_s
        out = []
        for c, start in enumerate(starts):
            history = mt.system_tokens  # what turn k re-sends before its own user message
            for k in range(1, mt.turns + 1):
                at = start + (k - 1) * (mt.turn_gap_s + mt.think_s)
                if at >= end:
                    break
                before = ((f"conv{c}/t{k - 1}", history),) if k > 1 else ()
                prompt, output = history + users[c][k - 1], outs[c][k - 1]
                out.append(
                    SimRequest(
                        at,
                        prompt,
                        output,
                        prefixes=system + before,
                        key=f"conv{c}/t{k}",
                        tier=tiers[c],
                        kind="multi-turn",
                    )
                )
                history = prompt + output
        return out

    def _components(self) -> list[tuple[float, float, float]]:
        """(requests/s, mean prompt, mean output) of the stream (or the turns), each burst."""
        parts = []
        if self.multi_turn:
            mt = self.multi_turn
            starts = self.rate
            if mt.concurrency and mt.span_s() > 0:
                starts = min(starts, mt.concurrency / mt.span_s())
            parts.append((starts * mt.turns, mt.mean_prompt(), mt.output.expected()))
        elif self.prompt and self.output:
            shared = self.shared_prefix.tokens if self.shared_prefix else 0
            parts.append((self.rate, self.prompt.expected() + shared, self.output.expected()))
        for b in self.bursts:
            rate = len(self.burst_times(b)) * b.size / self.horizon_s()
            parts.append((rate, b.prompt.expected(), b.output.expected()))
        return parts

    def request_rate(self) -> float:
        """Requests/s, all parts together: the stream's rate; a conversation's turns as they
        start at ``rate`` (or at ``concurrency`` / its span, when that is less); each burst's
        requests over the horizon."""
        return sum(rate for rate, _, _ in self._components())

    def mean_prompt_tokens(self) -> float:
        parts = self._components()
        return sum(r * p for r, p, _ in parts) / sum(r for r, _, _ in parts)

    def mean_output_tokens(self) -> float:
        parts = self._components()
        return sum(r * o for r, _, o in parts) / sum(r for r, _, _ in parts)

    def describe(self) -> str:
        text = []
        if self.multi_turn:
            text.append(self.multi_turn.describe(self.rate))
        elif self.prompt and self.output:
            span = f"for {self.duration_s:g} s" if self.duration_s else f"× {self.num_requests}"
            text.append(
                f"{self.rate:g} req/s {span}, prompt {self.prompt.describe()}, output "
                f"{self.output.describe()}"
            )
            if self.shared_prefix:
                p = self.shared_prefix
                text[-1] += f" after one of {p.groups} shared prefixes of {p.tokens} tokens"
        if self.burstiness != 1:
            text[0] += f", burstiness {self.burstiness:g}"
        text += [b.describe() for b in self.bursts]
        if self.tiers:
            text.append("tiers " + ", ".join(f"{t.tier}: {t.share:g}" for t in self.tiers))
        return "; ".join([*text, f"seed {self.seed}"])

    def scaled(self, fraction: float) -> WorkloadSpec:
        check_number(fraction, "fraction", 1.0)
        bursts = []
        for i, b in enumerate(self.bursts):
            exact = b.size * fraction
            size = _rounded(exact)
            if size < 1 or abs(size - exact) > BURST_ROUNDING * exact:
                raise SpecError(
                    f"bursts[{i}].size",
                    f"{b.size} × {fraction:g} = {exact:g} requests, not a whole burst (within "
                    f"{BURST_ROUNDING:.0%}): scale by a fraction that divides it",
                )
            bursts.append(replace(b, size=size))
        mt = self.multi_turn
        if mt:
            slots = mt.concurrency and max(1, _rounded(mt.concurrency * fraction))
            conversations = max(1, _rounded(mt.conversations * fraction))
            mt = replace(mt, conversations=conversations, concurrency=slots)
        count = self.num_requests and max(1, _rounded(self.num_requests * fraction))
        return replace(
            self,
            rate=self.rate * fraction,
            num_requests=count,
            bursts=tuple(bursts),
            multi_turn=mt,
        )


def _rounded(value: float) -> int:
    """Half up (Python's round() goes to even)."""
    return math.floor(value + 0.5)


def _offsets(n: int, spec: WorkloadSpec, rng: np.random.Generator) -> list[float]:
    """bench/arrivals.py ``arrival_offsets``: n send times from 0."""
    if n == 0:
        return []
    scale = 1.0 / (spec.rate * spec.burstiness)
    gaps = rng.gamma(shape=spec.burstiness, scale=scale, size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def _stream_arrivals(spec: WorkloadSpec, rng: np.random.Generator) -> Times:
    """``num_requests`` arrivals, or those before ``duration_s``: gaps drawn in chunks (numpy
    draws a gamma sample element by element: these are the first of the bench's
    ``arrival_offsets`` for the same seed, however many it drew)."""
    if spec.duration_s is None:
        return np.array(_offsets(spec.num_requests or 0, spec, rng), dtype=np.float64)
    scale = 1.0 / (spec.rate * spec.burstiness)
    chunk = math.ceil(spec.rate * spec.duration_s * 1.1) + 16
    gaps = [np.zeros(1)]
    while True:
        gaps.append(rng.gamma(shape=spec.burstiness, scale=scale, size=chunk))
        times: Times = np.cumsum(np.concatenate(gaps))
        if times[-1] >= spec.duration_s:
            return times[times < spec.duration_s]
        if len(times) > MAX_REQUESTS:
            raise SpecError("duration_s", f"more than {MAX_REQUESTS} arrivals drawn")
