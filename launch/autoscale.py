"""``pdserve serve --autoscale``: acting on the planner's plan on this machine.

    gateway GET /planner ──▶ Desired(prefill, decode, reason) ──▶ Autoscaler.tick ──▶ Pool
    gateway GET /metrics ──▶ requests per worker (which one to retire)       start / retire / kill

Workers live in ``--max-workers`` slots, each with its own CURVE identity (``worker-<i>``, made
once per launch and allowed both worker roles), so a slot restarts in either role under the same
key. A slot's lifecycle::

    empty ──start──▶ serving ──retire (SIGTERM: it drains)──▶ draining ──exit──▶ empty
                                                                 │  └─ a turn: started at once
                                                                 │     in the other role
                                                                 └─ past the drain timeout: killed

A draining worker is no capacity (the coordinator sends it nothing new) and is not supervised:
its exit is the end of its retirement, never a crash to restart. Each period the plan is read
and each role changes by at most one worker: grow into an empty slot, else turn a worker of a
role the plan wants smaller; shrink (never below one per role) by retiring the worker with the
fewest requests (ties: the most recently started). Every action is one line on stderr.
"""

from __future__ import annotations

import argparse
import enum
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pdserve.launch.plan_source import ROLES, Desired

MIN_PER_ROLE = 1


def slot_name(index: int) -> str:
    """Slot ``index``'s CURVE identity (both worker roles)."""
    return f"worker-{index}"


class Proc(Protocol):
    """A worker process as the autoscaler sees it (``launch.children.Child``)."""

    def alive(self) -> bool: ...

    def kill(self) -> None: ...


class Pool(Protocol):
    """Starts and retires worker processes (``launch.serve.Cluster``)."""

    def start_worker(self, role: str, slot: int, worker_id: str) -> Proc:
        """Start ``role`` as ``worker_id`` with slot ``slot``'s identity, supervised."""
        ...

    def retire(self, proc: Proc) -> None:
        """Stop supervising ``proc`` (its exit is not a crash) and SIGTERM it: it drains."""
        ...


class SlotState(enum.Enum):
    EMPTY = "empty"
    SERVING = "serving"
    DRAINING = "draining"


@dataclass
class Slot:
    """One identity and the worker it runs now (if any)."""

    index: int
    state: SlotState = SlotState.EMPTY
    role: str = ""
    worker_id: str = ""
    proc: Proc | None = None
    started: int = 0  # start order: the most recent is retired first among equals
    deadline: float = 0.0  # draining: killed if still alive then
    killed: bool = False
    turn_to: str = ""  # draining: the role the slot restarts in when the worker exits


class Autoscaler:
    """Owns the slots and acts on ``desired`` (None: no plan now, nothing changes) every
    ``period_s``; ``load`` gives requests per worker id (running + waiting). Reaping is done at
    every ``tick``, so a turn restarts its slot as soon as the drained worker exits."""

    def __init__(
        self,
        pool: Pool,
        desired: Callable[[], Desired | None],
        load: Callable[[], Mapping[str, int]],
        *,
        max_workers: int,
        drain_timeout_s: float,
        period_s: float = 2.0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if max_workers < 2:
            raise ValueError("--max-workers must be >= 2 (one prefill and one decode worker)")
        self.pool = pool
        self.desired = desired
        self.load = load
        self.slots = [Slot(i) for i in range(max_workers)]
        self.drain_timeout_s = drain_timeout_s
        self.period_s = period_s
        self.log = log or _stderr
        self.plan: Desired | None = None
        self._next_plan = float("-inf")
        self._starts = 0  # worker ids and start order

    def adopt(self, role: str, worker_id: str, proc: Proc) -> None:
        """A worker started with the cluster, in the next empty slot."""
        slot = self._empty()
        if slot is None:
            raise ValueError("more starting workers than --max-workers")
        self._fill(slot, role, worker_id, proc)

    def live(self, role: str) -> int:
        """Workers of ``role`` that are capacity: serving or starting, not draining."""
        return sum(s.state is SlotState.SERVING and s.role == role for s in self.slots)

    def tick(self, now: float) -> None:
        self._reap(now)
        if now < self._next_plan:
            return
        self._next_plan = now + self.period_s
        plan = self.desired()
        if plan is None:
            return
        old = self.plan
        if old is None or (old.prefill, old.decode) != (plan.prefill, plan.decode):
            self.log(f"plan: prefill {plan.prefill}, decode {plan.decode} ({plan.reason})")
        self.plan = plan
        self._act(plan, now)

    def _act(self, plan: Desired, now: float) -> None:
        changed: set[str] = set()
        deficit = sorted(ROLES, key=lambda r: (self._pending(r) + self.live(r) - plan.of(r), r))
        for role in deficit:
            if role not in changed and plan.of(role) > self.live(role) + self._pending(role):
                changed |= self._grow(role, plan, now)
        for role in ROLES:
            live = self.live(role)
            if role not in changed and plan.of(role) < live and live > MIN_PER_ROLE:
                self._drain(role, now, f"shrink {role} {live} -> {live - 1}", plan)

    def _grow(self, role: str, plan: Desired, now: float) -> set[str]:
        """One more ``role`` worker: in an empty slot, else in the slot of a worker already
        draining, else by turning one of the other role that the plan wants fewer of. The roles
        changed."""
        live = self.live(role)
        slot = self._empty()
        if slot is not None:
            worker_id = self._start(slot, role)
            self.log(
                f"grow {role} {live} -> {live + 1}: start {worker_id} in slot "
                f"{slot_name(slot.index)} (plan: {plan.reason})"
            )
            return {role}
        retiring = next(
            (s for s in self.slots if s.state is SlotState.DRAINING and not s.turn_to), None
        )
        if retiring is not None:  # a retirement under way: its slot restarts in ``role``
            retiring.turn_to = role
            self.log(
                f"turn {retiring.role} -> {role}: slot {slot_name(retiring.index)} restarts once "
                f"{retiring.worker_id} has drained (plan: {plan.reason})"
            )
            return {role}
        other = ROLES[1 - ROLES.index(role)]
        if self.live(other) <= max(plan.of(other), MIN_PER_ROLE):
            return set()  # every slot busy and nothing to give up: the plan waits
        why = f"turn {other} -> {role} (prefill/decode mix changed)"
        self._drain(other, now, why, plan).turn_to = role
        return {role, other}

    def _drain(self, role: str, now: float, why: str, plan: Desired) -> Slot:
        """Retire the ``role`` worker with the fewest requests (running and waiting, as the
        gateway's /metrics last had them), ties to the most recently started; its slot."""
        load = self.load()
        serving = [s for s in self.slots if s.state is SlotState.SERVING and s.role == role]
        slot = min(serving, key=lambda s: (load.get(s.worker_id, 0), -s.started))
        assert slot.proc is not None  # a serving slot runs a worker
        slot.state, slot.deadline = SlotState.DRAINING, now + self.drain_timeout_s
        self.pool.retire(slot.proc)
        where = f"slot {slot_name(slot.index)}, {load.get(slot.worker_id, 0)} in flight"
        self.log(f"{why}: drain {slot.worker_id} ({where}) (plan: {plan.reason})")
        return slot

    def _reap(self, now: float) -> None:
        for slot in self.slots:
            if slot.state is not SlotState.DRAINING or slot.proc is None:
                continue
            if slot.proc.alive():
                if now >= slot.deadline and not slot.killed:
                    slot.proc.kill()
                    slot.killed = True
                    self.log(
                        f"killed {slot.worker_id}: still draining after {self.drain_timeout_s:.0f}s"
                    )
                continue
            self.log(f"retired {slot.worker_id} (slot {slot_name(slot.index)} free)")
            role, slot.turn_to = slot.turn_to, ""
            slot.state, slot.proc, slot.killed = SlotState.EMPTY, None, False
            if role:
                self._finish_turn(slot, role)

    def _finish_turn(self, slot: Slot, role: str) -> None:
        """A turned slot's worker exited: start it as ``role`` if the plan still wants one."""
        plan = self.plan
        if plan is not None and plan.of(role) <= self.live(role) + self._pending(role):
            self.log(f"slot {slot_name(slot.index)} stays empty: the plan no longer wants {role}")
            return
        worker_id = self._start(slot, role)
        self.log(f"turned slot {slot_name(slot.index)} to {role}: start {worker_id}")

    def _pending(self, role: str) -> int:
        """Draining slots that restart as ``role`` (a turn under way)."""
        return sum(s.state is SlotState.DRAINING and s.turn_to == role for s in self.slots)

    def _empty(self) -> Slot | None:
        return next((s for s in self.slots if s.state is SlotState.EMPTY), None)

    def _start(self, slot: Slot, role: str) -> str:
        worker_id = f"{role}-{self._starts}"
        self._fill(slot, role, worker_id, self.pool.start_worker(role, slot.index, worker_id))
        return worker_id

    def _fill(self, slot: Slot, role: str, worker_id: str, proc: Proc) -> None:
        self._starts += 1
        slot.state, slot.role, slot.worker_id, slot.proc = SlotState.SERVING, role, worker_id, proc
        slot.started = self._starts


def add_autoscale_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--autoscale",
        action="store_true",
        help="act on the planner (the gateway's GET /planner): start workers, retire them by "
        "drain, turn a worker between prefill and decode by drain-and-restart; --prefill and "
        "--decode are the starting counts, each worker gets cores // --max-workers threads "
        "(--mode disagg only)",
    )
    g.add_argument(
        "--max-workers",
        type=int,
        default=None,
        help="--autoscale: prefill + decode workers at most (default: the cores)",
    )
    g.add_argument(
        "--autoscale-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="--autoscale: seconds between reads of the plan, one change per role each "
        "(default: --planner-interval, how often the planner plans)",
    )


def check_autoscale_args(args: argparse.Namespace, cores: int) -> str | None:
    """Why ``args`` cannot autoscale, or None; fills in ``--max-workers``'s default."""
    if not args.autoscale:
        given = args.max_workers is not None or args.autoscale_interval is not None
        return "--max-workers and --autoscale-interval are for --autoscale" if given else None
    if args.mode != "disagg":
        return "--autoscale sizes the prefill and decode pools apart: it needs --mode disagg"
    args.max_workers = cores if args.max_workers is None else args.max_workers
    if args.max_workers < 2:
        return f"--max-workers must be >= 2 (a prefill and a decode worker), not {args.max_workers}"
    if args.prefill < 1 or args.decode < 1 or args.prefill + args.decode > args.max_workers:
        return (
            f"--autoscale starts with --prefill {args.prefill} and --decode {args.decode}: at "
            f"least 1 each and {args.max_workers} (--max-workers) in all"
        )
    if args.autoscale_interval is None:
        args.autoscale_interval = args.planner_interval
    if not args.autoscale_interval > 0:
        return "--autoscale-interval must be > 0 seconds"
    if args.planner_max_workers == 0:  # the planner asks for no more workers than there are slots
        args.planner_max_workers = args.max_workers
    return None


def _stderr(line: str) -> None:
    print(f"pdserve serve: autoscale: {line}", file=sys.stderr, flush=True)
