"""The planner's seat in the coordinator: what it reads and when it runs (the policy itself is
``coordinator.planner``, pure and tested apart).

It counts each model's arrivals (``Generate``: choices and their prompt tokens), pools the
latency samples every gateway sends in its hello (TTFT, TPOT, output tokens), and every
``interval_s`` reads the pools' figures off the registry (prefill queue, decode KV use, live
workers and the tensor-parallel size they registered) into a ``Load`` for each model's
``Planner``. Its plans go to the gateways in ``ClusterState`` (``/metrics``, ``GET
/planner``), and, with ``auto_local``, each plan's ``max_local_prefill_tokens`` is the
conditional-disaggregation threshold the coordinator applies (``threshold``).

Everything it keeps is bounded: arrivals and samples older than ``window_s`` are dropped, and
at most ``MAX_POINTS`` of each per model are kept (the oldest go first).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.coordinator.planner import Load, Plan, Planner, PlannerConfig, Targets
from pdserve.coordinator.registry import Worker, WorkerRegistry
from pdserve.protocol import messages as m
from pdserve.protocol.planning import PlanReport, samples_problem
from pdserve.runtime.loop import RateLimitedLog

logger = logging.getLogger(__name__)

MAX_POINTS = 65_536  # per model and kind: a window's worth at any rate this machine serves


def _points() -> deque[Any]:
    return deque(maxlen=MAX_POINTS)


@dataclass
class _Pool:
    """One model's recent figures since ``created``: (time, value) pairs, oldest first."""

    created: float
    arrivals: deque[tuple[float, int, int]] = field(default_factory=lambda: _points())
    ttft: deque[tuple[float, float]] = field(default_factory=lambda: _points())
    tpot: deque[tuple[float, float]] = field(default_factory=lambda: _points())
    output: deque[tuple[float, int]] = field(default_factory=lambda: _points())
    max_tokens: deque[tuple[float, int]] = field(default_factory=lambda: _points())

    def expire(self, since: float) -> None:
        for points in (self.arrivals, self.ttft, self.tpot, self.output, self.max_tokens):
            while points and points[0][0] < since:
                points.popleft()


class Planning:
    """Runs one ``Planner`` per served model (made by ``make_planner(model)``) on the live
    figures; ``plans`` holds the latest."""

    def __init__(
        self,
        registry: WorkerRegistry,
        make_planner: Callable[[str], Planner],
        *,
        interval_s: float = 5.0,
        window_s: float = 30.0,
        auto_local: bool = False,
        queued: Callable[[str], int] = lambda model: 0,
    ) -> None:
        self.registry = registry
        self.make_planner = make_planner
        self.interval_s = interval_s
        self.window_s = window_s
        self.auto_local = auto_local
        self.queued = queued  # requests of a model waiting for decode blocks
        self.planners: dict[str, Planner] = {}
        self.plans: dict[str, Plan] = {}
        self._pools: dict[str, _Pool] = {}
        self._next_at = -math.inf
        self._refusals = RateLimitedLog()

    # ---- what it hears -----------------------------------------------------------------------
    def arrived(self, req: m.Generate, now: float) -> None:
        """A request came in (not a migrating choice: that one arrived before)."""
        if req.resume_choice is not None:
            return
        pool = self._pool(req.model, now)
        if pool is not None:
            pool.arrivals.append((now, req.n, len(req.prompt_token_ids)))
            pool.max_tokens.append((now, req.sampling.max_tokens))

    def heard(self, hello: m.GatewayHello, now: float) -> None:
        """A gateway's samples; a list that cannot be true is dropped whole, and logged."""
        for s in hello.samples:
            problem = samples_problem(s)
            if problem is not None:
                self._refusals.error(
                    f"samples {hello.stream_address}",
                    "dropped latency samples from gateway %s: %s",
                    hello.stream_address,
                    problem,
                )
                continue
            pool = self._pool(s.model, now)
            if pool is None:
                continue
            pool.ttft.extend((now, x) for x in s.ttft_s)
            pool.tpot.extend((now, x) for x in s.tpot_s)
            pool.output.extend((now, n) for n in s.output_tokens)

    def _pool(self, model: str, now: float) -> _Pool | None:
        """The model's pool; None for a model no worker serves (a gateway's word alone does
        not make one: the pools stay as many as the models)."""
        if model not in self._pools:
            if model not in self.registry.models():
                return None
            self._pools[model] = _Pool(now)
        return self._pools[model]

    # ---- what it says ------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Plan every served model, once per ``interval_s``."""
        if now < self._next_at:
            return
        self._next_at = now + self.interval_s
        registry = self.registry  # an embedding model has no prefill and decode pools to plan
        served = {model for model in registry.models() if not registry.embeds(model)}
        for model in [m_ for m_ in self._pools if m_ not in served]:
            del self._pools[model]
        for model in [m_ for m_ in self.plans if m_ not in served]:
            del self.plans[model], self.planners[model]
        for model in sorted(served):
            load = self.load(model, now)
            if load is None:
                continue
            if model not in self.planners:
                self.planners[model] = self.make_planner(model)
            plan = self.planners[model].plan(model, load, now)
            old = self.plans.get(model)
            if old is None or (old.prefill, old.decode) != (plan.prefill, plan.decode):
                logger.info(
                    "planner: %s wants %d prefill, %d decode workers (%s)",
                    model,
                    plan.prefill,
                    plan.decode,
                    plan.reason,
                )
            self.plans[model] = plan

    def load(self, model: str, now: float) -> Load | None:
        """The model's figures now; None for a colocated pool (not planned: no split to size)."""

        workers = [w for w in self.registry.workers.values() if w.info.model == model]
        if any(w.info.role == "both" for w in workers):
            return None
        pool = self._pools.setdefault(model, _Pool(now))
        pool.expire(now - self.window_s)
        # a rate over the time it has watched: a new pool's window is not full yet
        watched = max(self.interval_s, min(self.window_s, now - pool.created))
        live = [w for w in workers if not w.load.draining]
        prefill = [w for w in live if w.info.role == "prefill"]
        decode = [w for w in live if w.info.role == "decode"]
        choices = sum(n for _, n, _ in pool.arrivals)
        prompts = [p for _, _, p in pool.arrivals]
        # output lengths: what the gateways saw, else what the decode workers learned, else
        # (nothing finished yet) what the requests asked
        learned = [w.load.expected_output_tokens for w in decode if w.load.expected_output_tokens]
        outputs = [n for _, n in pool.output] or learned or [n for _, n in pool.max_tokens]
        return Load(
            arrival_rate=choices / watched,
            prompt_tokens=_mean(prompts),
            output_tokens=_mean(outputs),
            prefill_queue_tokens=sum(w.load.queued_prompt_tokens for w in prefill),
            decode_running=sum(w.load.running for w in decode),
            decode_waiting=self.queued(model),
            # live use plus the growth its sequences are expected to take (admission by need)
            kv_used_blocks=sum(w.load.used_blocks + w.load.growth_blocks for w in decode),
            kv_total_blocks=sum(w.load.total_blocks for w in decode),
            ttft_p90_s=_p90(x for _, x in pool.ttft),
            tpot_p90_s=_p90(x for _, x in pool.tpot),
            prefill_workers=len(prefill),
            decode_workers=len(decode),
            prefill_tp=_usual_tp(prefill),
            decode_tp=_usual_tp(decode),
        )

    def threshold(self, model: str) -> int | None:
        """The local-prefill threshold the planner set for ``model``; None: not planning it
        (the flag's figure holds)."""
        if not self.auto_local:
            return None
        plan = self.plans.get(model)
        return plan.max_local_prefill_tokens if plan is not None else None

    def reports(self) -> list[PlanReport]:
        return [
            PlanReport(
                model=p.model,
                prefill=p.prefill,
                decode=p.decode,
                max_local_prefill_tokens=p.max_local_prefill_tokens,
                reason=p.reason,
                load={k: _number(v) for k, v in asdict(p.load).items()},
            )
            for p in sorted(self.plans.values(), key=lambda p: p.model)
        ]


def _usual_tp(workers: list[Worker]) -> int:
    """The tensor-parallel size most of ``workers`` run at (a tie: the smaller, slower one,
    which errs toward more workers); 1 for none."""
    counts = Counter(w.info.tensor_parallel_size for w in workers)
    return max(counts, key=lambda tp: (counts[tp], -tp), default=1)


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _p90(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def _number(v: object) -> float | None:
    return None if v is None else float(v)  # type: ignore[arg-type]


def default_planner(model: str) -> Planner:
    """A planner with no profile and the default SLOs: live signals alone."""
    return Planner((), Targets(), PlannerConfig())
