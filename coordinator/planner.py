"""The planner: how many prefill and decode workers a model wants, and which prompts a decode
worker prefills itself. A pure policy (no clock, no I/O): the coordinator calls
``plan(model, load, now)`` on its tick; whatever scales workers acts on the ``Plan``.

The demand of each pool, in workers, is coordinator/demand.py's (from the load and the
profile; from the live signals alone without one). On it::

    wanted = max(ceil(demand · (1 + spare)) (+ min_spare while there is load),
                 live + 1 where a live signal says the role falls short,
                 min_<role>)

Profiles are by tensor-parallel size: a pool of groups of N ranks is sized (in groups) with
the model's profile measured at N (``Load.prefill_tp``, ``Load.decode_tp``: the size most of
the role's workers run at). A role whose size has no profile is planned as with none (live
signals; the local-prefill threshold 0 without a decode profile), and where the planner has
profiles at other sizes its reason says "no profile at TP N".

Live signals: TTFT p90 over target → prefill (unless its queue is empty while requests wait
for decode blocks); TPOT p90 over target (where the profile says one sequence's step can meet
it), KV use ≥ kv_high, requests waiting for blocks → decode; without a profile, a prefill
queue over queue_tokens_per_prefill a worker → prefill.
live + 1, not plan + 1: a miss adds one worker, then nothing more while it starts.

Hysteresis: a role scales up at once (again only after scale_up_cooldown_s); down only when
even demand · (1 + hysteresis) wants fewer, after that has held scale_down_cooldown_s, one
worker a step (a load flapping faster than that never scales down). max_workers: wanted
counts over it are split in their ratio (mins kept); a role grows only into room the other
leaves. The spare margin is a fraction (min_spare 0 by default): min_<role> keeps a worker
warm, and a whole extra one per role costs a core each on a small machine. Pool sizes ignore
local prefills (the threshold keeps those short).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pdserve.coordinator.demand import (
    Load,
    Targets,
    clean_load,
    decode_demand,
    local_prefill_threshold,
    prefill_demand,
    tpot_reachable,
)
from pdserve.coordinator.profile import Profile

__all__ = ["Load", "Plan", "Planner", "PlannerConfig", "Targets"]

ROLES = ("prefill", "decode")
MAX_WORKERS = 1 << 16  # a bound on any figure, whatever the load says


@dataclass(frozen=True)
class PlannerConfig:
    """The policy's knobs (module docstring for where each acts)."""

    min_prefill: int = 1
    min_decode: int = 1
    max_workers: int | None = None  # prefill + decode; None: no cap
    spare: float = 0.2  # warm-spare margin, a fraction of the demand
    min_spare: int = 0  # whole spare workers per role while there is load
    hysteresis: float = 0.15  # scale down only when demand raised by this still wants fewer
    scale_up_cooldown_s: float = 10.0  # between two scale-ups of a role (workers start)
    scale_down_cooldown_s: float = 60.0  # a lower count holds this long before each step down
    kv_high: float = 0.85  # decode KV use that asks for one more decode worker
    max_batch: int = 64  # sequences a decode worker runs (its --max-num-seqs)
    queue_tokens_per_prefill: int = 2048  # no profile: prompt tokens queued a worker may hold
    max_local_prefill_cap: int = 4096  # the threshold never exceeds this

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"planner {f.name} must be >= 0, got {value}")
        if self.max_batch < 1 or self.queue_tokens_per_prefill < 1:
            raise ValueError("planner max_batch and queue_tokens_per_prefill must be >= 1")
        if not 0 < self.kv_high <= 1:
            raise ValueError(f"planner kv_high must be in (0, 1], got {self.kv_high}")
        if self.max_workers is not None and self.max_workers < self.min_prefill + self.min_decode:
            raise ValueError(
                f"planner max_workers {self.max_workers} is below min_prefill + min_decode"
            )


@dataclass(frozen=True)
class Plan:
    model: str
    prefill: int
    decode: int
    max_local_prefill_tokens: int
    reason: str  # which signal drove each role's figure
    load: Load

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "prefill": self.prefill,
            "decode": self.decode,
            "max_local_prefill_tokens": self.max_local_prefill_tokens,
            "reason": self.reason,
            "load": asdict(self.load),
        }


@dataclass
class _Role:
    """One role's hysteresis memory: the planned count, the last scale-up, since when a lower
    count has been wanted."""

    target: int
    last_up: float | None = None
    low_since: float | None = None
    note: str = ""


@dataclass
class _Want:
    """A role's wanted count (``up``), the count with demand raised by the hysteresis
    (``down``: below the plan, a step down), and the signal behind ``up``."""

    up: int
    down: int
    why: str


@dataclass
class _Memory:
    roles: dict[str, _Role] = field(default_factory=dict)


class Planner:
    """Desired prefill/decode workers and the local-prefill threshold from live load, the
    model's profiles (none, or one a tensor-parallel size) and SLO targets. State: per model,
    each role's hysteresis memory."""

    def __init__(
        self, profiles: Iterable[Profile], targets: Targets, config: PlannerConfig
    ) -> None:
        self.profiles: dict[int, Profile] = {}  # by tensor-parallel size
        for p in profiles:
            if p.tensor_parallel_size in self.profiles:
                raise ValueError(
                    f"two profiles of {p.model!r} at tensor-parallel size {p.tensor_parallel_size}"
                )
            self.profiles[p.tensor_parallel_size] = p
        self.targets = targets
        self.config = config
        self._memory: dict[str, _Memory] = {}

    def profile(self, tp: int) -> Profile | None:
        """The profile of a worker of ``tp`` ranks, if there is one."""
        return self.profiles.get(tp)

    def plan(self, model: str, load: Load, now: float) -> Plan:
        load = clean_load(load)
        prefill, decode = self.profile(load.prefill_tp), self.profile(load.decode_tp)
        wants = {
            "prefill": self._prefill_want(prefill, load),
            "decode": self._decode_want(decode, load),
        }
        capped = self._cap(wants)
        memory = self._memory.setdefault(model, _Memory())
        for role in ROLES:
            live = load.prefill_workers if role == "prefill" else load.decode_workers
            memory.roles.setdefault(role, _Role(target=max(live, self._min(role))))
        for role in ROLES:  # steps down first: a capped role grows into the room they leave
            self._step_down(memory.roles[role], wants[role], now)
        for role in ROLES:
            other = memory.roles[ROLES[1 - ROLES.index(role)]].target
            room = None if self.config.max_workers is None else self.config.max_workers - other
            self._step_up(memory.roles[role], wants[role], now, room)
        sizes = {"prefill": load.prefill_tp, "decode": load.decode_tp}
        reason = "; ".join(
            f"{role} {memory.roles[role].target}: {wants[role].why}"
            f"{self._missing(sizes[role])}{memory.roles[role].note}"
            for role in ROLES
        )
        return Plan(
            model=model,
            prefill=memory.roles["prefill"].target,
            decode=memory.roles["decode"].target,
            max_local_prefill_tokens=local_prefill_threshold(
                decode, self.targets, load, self.config.max_local_prefill_cap, prefill
            ),
            reason=reason + (f"; capped at {self.config.max_workers}" if capped else ""),
            load=load,
        )

    def _missing(self, tp: int) -> str:
        """The reason's note for a role whose size has no profile where others have one."""
        return f" (no profile at TP {tp})" if self.profiles and tp not in self.profiles else ""

    # ---- wanted counts ------------------------------------------------------------------------
    def _prefill_want(self, profile: Profile | None, load: Load) -> _Want:
        c, t = self.config, self.targets
        queued = load.prefill_queue_tokens
        blamed = queued > 0 or load.decode_waiting == 0  # else decode blocks held it up
        floors = [("ttft>slo", _over(load.ttft_p90_s, t.ttft_s) and blamed)]
        if profile is None:
            long_queue = queued > c.queue_tokens_per_prefill * max(1, load.prefill_workers)
            floors.append(("queue", long_queue))
        demand = prefill_demand(profile, t, load, c.queue_tokens_per_prefill)
        return self._want("prefill", demand, floors, load.prefill_workers, _busy(load))

    def _decode_want(self, profile: Profile | None, load: Load) -> _Want:
        use = load.kv_used_blocks / load.kv_total_blocks if load.kv_total_blocks else 0.0
        reachable = tpot_reachable(profile, self.targets, load)
        floors = [
            ("tpot>slo", _over(load.tpot_p90_s, self.targets.tpot_s) and reachable),
            ("kv use", use >= self.config.kv_high),
            ("waiting", load.decode_waiting > 0),
        ]
        demand = decode_demand(profile, self.targets, load, self.config.max_batch)
        note = "" if reachable else " (tpot out of reach)"
        return self._want("decode", demand, floors, load.decode_workers, _busy(load), note)

    def _want(
        self,
        role: str,
        demand: tuple[str, float],
        floors: list[tuple[str, bool]],
        live: int,
        busy: bool,
        note: str = "",
    ) -> _Want:
        c = self.config
        name, need = demand
        extra = c.min_spare if busy else 0
        up = self._count(need, extra)
        down = self._count(need * (1 + c.hysteresis), extra)
        why = (f"{name} {need:.2f}" if need > 0 else "idle") + note
        for signal, hit in floors:
            if hit and live + 1 > up:
                up, down, why = live + 1, max(down, live + 1), signal
        if self._min(role) > up:
            up, why = self._min(role), f"min ({why})" if why != "idle" else "min"
        return _Want(up=up, down=max(down, up), why=why)

    def _count(self, demand: float, extra: int) -> int:
        if not demand > 0:
            return 0
        wanted = min(demand * (1 + self.config.spare), MAX_WORKERS)
        return math.ceil(wanted - 1e-9) + extra

    def _min(self, role: str) -> int:
        return self.config.min_prefill if role == "prefill" else self.config.min_decode

    def _cap(self, wants: dict[str, _Want]) -> bool:
        """Split ``max_workers`` by the wanted counts where they exceed it (in place); whether
        the wanted counts exceeded it."""
        cap, c = self.config.max_workers, self.config
        if cap is None:
            return False
        capped = wants["prefill"].up + wants["decode"].up > cap
        for attr in ("up", "down"):
            p, d = getattr(wants["prefill"], attr), getattr(wants["decode"], attr)
            if p + d <= cap:
                continue
            share = int(cap * p / (p + d) + 0.5)
            new_p = min(p, max(c.min_prefill, min(share, cap - c.min_decode)))
            new_d = min(d, cap - new_p)
            setattr(wants["prefill"], attr, min(p, cap - new_d))
            setattr(wants["decode"], attr, new_d)
        for want in wants.values():
            want.down = max(want.down, want.up)
        return capped

    # ---- hysteresis ---------------------------------------------------------------------------
    def _step_down(self, role: _Role, want: _Want, now: float) -> None:
        role.note = ""
        if want.down >= role.target or want.up > role.target:
            role.low_since = None
            return
        if role.low_since is None:
            role.low_since = now
        held = now - role.low_since
        if held >= self.config.scale_down_cooldown_s:
            role.target -= 1
            role.low_since = now
            role.note = " (stepped down)"
        else:
            left = self.config.scale_down_cooldown_s - held
            role.note = f" (down one in {left:.0f} s)"

    def _step_up(self, role: _Role, want: _Want, now: float, room: int | None) -> None:
        up = want.up if room is None else min(want.up, room)
        if up <= role.target:
            return
        if role.last_up is not None and now - role.last_up < self.config.scale_up_cooldown_s:
            role.note = " (up cool-down)"
            return
        role.target, role.last_up, role.low_since = up, now, None


def _over(observed: float | None, target: float) -> bool:
    return observed is not None and observed > target


def _busy(load: Load) -> bool:
    return load.arrival_rate > 0 or load.decode_running > 0 or load.prefill_queue_tokens > 0
