"""Versions of a model behind one name: the rollout table, the admin's commands on it, and
the canary gate acting on it.

    flags (--model NAME@v1 --model NAME@v2 --canary NAME@v2=5%)
        └─▶ RolloutTable: NAME -> stable version, version -> percent of NAME's requests
    RolloutCommand (admin key) ─▶ Rollouts.command ─▶ table ─▶ RolloutAnswer to its sender
    GatewayHello.samples ─▶ CanaryGate ─▶ tick: a canary over its margins goes to 0 (logged)
    table ─▶ ClusterState.rollouts ─▶ gateways, which pick a version per conversation: with
             each gateway's hello, and at once to every gateway heard lately when it changes

The gateways resolve a request to one version when it arrives, so a change here never moves a
stream in flight: it finishes where it started. Versions are served models of their own
(``NAME@VERSION``, their own pools); a version a command names must be declared (by flag) or
have registered workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.coordinator.canary_gate import CanaryGate, GateConfig
from pdserve.coordinator.registry import WorkerRegistry
from pdserve.coordinator.routes import CoordinatorOutbox
from pdserve.protocol import messages as m
from pdserve.protocol.rollouts import (
    MAX_ROLLOUTS,
    MAX_VERSIONS,
    Rollout,
    RolloutAnswer,
    RolloutCommand,
    check_name,
    check_weights,
    format_rollout,
    split_version,
    versioned,
)

logger = logging.getLogger(__name__)


class RolloutError(ValueError):
    """A change the table refuses, with the reason for the admin."""


class RolloutTable:
    """NAME -> its ``Rollout``: pure, no sockets, no clock. Every change is checked whole
    before it applies (weights 0 to 100 summing to 100, versions that exist)."""

    def __init__(self, rollouts: list[Rollout] | None = None) -> None:
        self._by_name: dict[str, Rollout] = {r.model: r for r in rollouts or []}

    @classmethod
    def from_flags(cls, models: list[str], canaries: list[str]) -> RolloutTable:
        """``models``: ``NAME@VERSION`` names (the first of a NAME its stable version);
        ``canaries``: ``NAME@VERSION=PCT[%]``, the stable version taking what they leave.
        ``ValueError`` naming the flag that is wrong."""
        versions: dict[str, list[str]] = {}
        for served in models:
            parts = split_version(served)
            if parts is None:
                raise ValueError(f"--model {served!r}: a version is named NAME@VERSION")
            name, version = parts
            if version in versions.setdefault(name, []):
                raise ValueError(f"--model {served}: version {version} of {name} is given twice")
            versions[name].append(version)
        weights = {name: dict.fromkeys(vs, 0) for name, vs in versions.items()}
        for spec in canaries:
            served, sep, pct = spec.partition("=")
            parts = split_version(served)
            if parts is None or not sep:
                raise ValueError(f"--canary {spec!r}: write NAME@VERSION=PERCENT (e.g. chat@v2=5%)")
            name, version = parts
            if version not in weights.get(name, {}):
                raise ValueError(f"--canary {spec}: no --model {served} to send requests to")
            if versions[name][0] == version:
                raise ValueError(f"--canary {spec}: {served} is {name}'s stable version")
            weights[name][version] = _percent(pct, f"--canary {spec}")
        table = cls()
        for name, ws in weights.items():
            stable = versions[name][0]
            ws[stable] = 100 - sum(ws.values())
            if ws[stable] < 0:
                raise ValueError(f"--canary: the canaries of {name} take over 100%")
            table._put(_rollout(name, stable, ws, "as started"))
        return table

    def rollouts(self) -> list[Rollout]:
        return [self._by_name[name] for name in sorted(self._by_name)]

    def get(self, name: str) -> Rollout | None:
        return self._by_name.get(name)

    def canaries(self) -> list[tuple[Rollout, str]]:
        """Each (rollout, canary version) that takes requests: what the gate watches."""
        return [(r, v) for r in self.rollouts() for v in r.order()[1:] if r.weights[v] > 0]

    # ---- changes (each returns the rollout as applied, or raises RolloutError) --------------

    def set_weights(self, name: str, weights: dict[str, int], known: set[str]) -> Rollout:
        """``weights`` for ``name``'s versions (those left out: 0); a new name's stable
        version is the first listed."""
        try:
            check_name(name)
            check_weights(weights)
        except ValueError as e:
            raise RolloutError(str(e)) from None
        if not weights:
            raise RolloutError("set needs at least one VERSION=PERCENT")
        current = self._by_name.get(name)
        unknown = sorted(set(weights) - known)
        if unknown:
            raise RolloutError(f"{name} has no version {', '.join(unknown)} ({_known(known)})")
        if sum(weights.values()) != 100:
            raise RolloutError(f"the weights sum to {sum(weights.values())}, not 100")
        if current is None and len(self._by_name) >= MAX_ROLLOUTS:
            raise RolloutError(f"at most {MAX_ROLLOUTS} names have versions")
        versions = dict.fromkeys(current.weights if current else [], 0) | weights
        if len(versions) > MAX_VERSIONS:
            raise RolloutError(f"at most {MAX_VERSIONS} versions of one name")
        stable = current.stable if current else next(iter(weights))
        gated = current.gate_rollbacks if current else 0
        return self._put(_rollout(name, stable, versions, "set by admin", gated))

    def promote(self, name: str, version: str, known: set[str]) -> Rollout:
        """``version`` becomes the stable one and takes every request."""
        if version not in known:
            raise RolloutError(f"{name} has no version {version} ({_known(known)})")
        current = self._by_name.get(name)
        versions = dict.fromkeys(current.weights if current else [], 0) | {version: 100}
        gated = current.gate_rollbacks if current else 0
        return self._put(_rollout(name, version, versions, "promoted by admin", gated))

    def rollback(
        self, name: str, reason: str = "rolled back by admin", gate: bool = False
    ) -> Rollout:
        """Every request to the stable version (``gate``: the canary gate's doing)."""
        current = self._by_name.get(name)
        if current is None:
            raise RolloutError(f"{name} has no versions to roll back")
        weights = {v: 100 if v == current.stable else 0 for v in current.weights}
        gated = current.gate_rollbacks + (1 if gate else 0)
        return self._put(_rollout(name, current.stable, weights, reason, gated))

    def _put(self, rollout: Rollout) -> Rollout:
        self._by_name[rollout.model] = rollout
        return rollout


def _rollout(
    name: str, stable: str, weights: dict[str, int], reason: str, gated: int = 0
) -> Rollout:
    ordered = {stable: weights[stable]} | weights  # stable first
    return Rollout(model=name, stable=stable, weights=ordered, reason=reason, gate_rollbacks=gated)


def _percent(text: str, where: str) -> int:
    digits = text.strip().removesuffix("%")
    if not digits.isdigit() or not 0 <= int(digits) <= 100:
        raise ValueError(f"{where}: the weight must be a whole percent, 0 to 100")
    return int(digits)


def _known(known: set[str]) -> str:
    return f"known: {', '.join(sorted(known))}" if known else "none is known"


class Rollouts:
    """The coordinator's part for rollouts: owns the table and the canary gate (None: off),
    answers the admin's commands, and acts on the gate's verdicts at each tick."""

    def __init__(
        self,
        outbox: CoordinatorOutbox,
        registry: WorkerRegistry,
        table: RolloutTable | None = None,
        gate: GateConfig | None = None,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        """``changed``: called when the table changed, before the command's answer goes (the
        coordinator sends its state to the gateways, so a rollback is not a hello late)."""
        self.outbox = outbox
        self.registry = registry
        self.table = table or RolloutTable()
        self.gate = CanaryGate(gate) if gate is not None else None
        self.declared = {r.model: set(r.weights) for r in self.table.rollouts()}
        self.changed = changed

    def rollouts(self) -> list[Rollout]:
        return self.table.rollouts()

    def known(self, name: str) -> set[str]:
        """``name``'s versions: declared by flag, in the table, or registered by workers."""
        registered = {split_version(model) for model in self.registry.models()}
        found = {p[1] for p in registered if p is not None and p[0] == name}
        current = self.table.get(name)
        return found | self.declared.get(name, set()) | set(current.weights if current else [])

    def command(self, cmd: RolloutCommand) -> None:
        """Apply an admin's command (its key's role was checked at the inbox) and answer it."""
        try:
            if cmd.action == "set":
                applied = [self.table.set_weights(cmd.model, cmd.weights, self.known(cmd.model))]
            elif cmd.action == "promote":
                applied = [self.table.promote(cmd.model, cmd.version, self.known(cmd.model))]
            elif cmd.action == "rollback":
                applied = [self.table.rollback(cmd.model)]
            else:
                applied = []
        except RolloutError as e:
            logger.warning("rollout %s %s refused: %s", cmd.action, cmd.model, e)
            answer = RolloutAnswer(request_id=cmd.request_id, error=str(e))
        else:
            for r in applied:
                logger.info("rollout %s", format_rollout(r))
                if self.gate is not None:  # a fresh start for every version it changed
                    for version in r.weights:
                        self.gate.forget(r.served(version))
            if applied:
                self.changed()
            shown = self.table.rollouts()
            if cmd.model:
                shown = [r for r in shown if r.model == cmd.model]
            answer = RolloutAnswer(request_id=cmd.request_id, rollouts=shown)
        self.outbox.to_gateway(cmd.reply_address, answer)

    def heard(self, hello: m.GatewayHello, now: float) -> None:
        if self.gate is not None:
            self.gate.heard(hello.samples, now, self._watched())

    def tick(self, now: float) -> None:
        """The gate's verdict on each canary taking requests; a breach rolls its name back."""
        if self.gate is None:
            return
        for rollout, canary in self.table.canaries():
            stable = rollout.served(rollout.stable)
            why = self.gate.check(stable, rollout.served(canary), now)
            if why is None:
                continue
            reason = f"canary gate: {rollout.served(canary)} {why}"
            applied = self.table.rollback(rollout.model, reason, gate=True)
            logger.warning("rolled %s back to %s: %s", rollout.model, stable, reason)
            logger.info("rollout %s", format_rollout(applied))
            self.gate.forget(rollout.served(canary))
            self.changed()

    def _watched(self) -> set[str]:
        """Every version of every name in the table (a bounded set)."""
        return {versioned(r.model, v) for r in self.table.rollouts() for v in r.weights}
