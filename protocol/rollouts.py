"""Rollouts on the wire: versions of a model behind one name, and the admin's control of them.

A version is a served model of its own, named ``NAME@VERSION`` (its workers register that
name: its own pools, prefix caches and per-model metrics). The coordinator keeps, per
``NAME``, the share of ``NAME``'s requests each version takes (``Rollout``) and sends it to
every gateway in ``ClusterState.rollouts``; a gateway picks a version per conversation
(``gateway.versions``)::

    pdserve rollout ── RolloutCommand (an ``admin`` key only) ─▶ coordinator
                    ◀─ RolloutAnswer (the table as applied, or why not) ──
    coordinator ── ClusterState.rollouts ─▶ gateways

Like ``Share``, each type here is valid or not made at all: construction raises ``ValueError``
naming the field, which the codec turns into a ``ProtocolError`` on decode. The rules that
need the cluster (versions that exist, weights that sum to 100) are the coordinator's
(``coordinator.rollouts``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from pdserve.protocol.codec import Message, message

SEPARATOR = "@"
NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")  # a model's name: no '@', '=' or space
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MAX_VERSIONS = 8  # versions of one name
MAX_ROLLOUTS = 64  # names with versions in one cluster
MAX_REASON = 1024
MAX_ID = 64
MAX_ADDRESS = 256
Action = Literal["status", "set", "promote", "rollback"]


def split_version(served: str) -> tuple[str, str] | None:
    """``chat@v2`` -> (``chat``, ``v2``); None for a name that is no version."""
    name, sep, version = served.partition(SEPARATOR)
    if not sep or not NAME.fullmatch(name) or not VERSION.fullmatch(version):
        return None
    return name, version


def versioned(name: str, version: str) -> str:
    return f"{name}{SEPARATOR}{version}"


def check_name(name: object, what: str = "model") -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{what} must be 1 to 128 of A-Z a-z 0-9 _ . : / -, got {name!r:.80}")


def check_weights(weights: object, what: str = "weights") -> None:
    """``weights``: at most ``MAX_VERSIONS`` versions, each a percent (an int 0 to 100)."""
    if not isinstance(weights, dict) or len(weights) > MAX_VERSIONS:
        raise ValueError(f"{what} must map at most {MAX_VERSIONS} versions to a percent")
    for version, weight in weights.items():
        if not isinstance(version, str) or not VERSION.fullmatch(version):
            reason = "a version is 1 to 64 of A-Z a-z 0-9 _ . - (a letter or digit first)"
            raise ValueError(f"{what}: {reason}, got {version!r:.80}")
        if type(weight) is not int or not 0 <= weight <= 100:
            raise ValueError(f"{what}: {version}'s weight must be 0 to 100, got {weight!r:.80}")


def _check_text(value: object, limit: int, what: str) -> None:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{what} must be a string of at most {limit} characters")


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One name's versions: the percent of the name's requests each takes (``stable`` first,
    then the rest as listed; they sum to 100), the version a rollback returns to, why the
    weights are what they are, and the canary gate's rollbacks of it so far."""

    model: str  # NAME; its versions are served as NAME@VERSION
    stable: str
    weights: dict[str, int]
    reason: str = ""
    gate_rollbacks: int = 0

    def __post_init__(self) -> None:
        check_name(self.model)
        check_weights(self.weights)
        if self.stable not in self.weights:
            raise ValueError(f"stable version {self.stable!r:.80} is not among the weights")
        _check_text(self.reason, MAX_REASON, "reason")
        if type(self.gate_rollbacks) is not int or self.gate_rollbacks < 0:
            raise ValueError("gate_rollbacks must be a count")

    def served(self, version: str) -> str:
        return versioned(self.model, version)

    def order(self) -> list[str]:
        """Its versions, stable first: the order a gateway lays their shares out in, so a
        canary's share grows into the stable's range from its end, never reshuffling it."""
        return [self.stable, *(v for v in self.weights if v != self.stable)]


@message("rollout_command")
@dataclass(frozen=True, kw_only=True)
class RolloutCommand(Message):
    """Admin → coordinator: ``status`` (every name's rollout, or ``model``'s), ``set``
    (``weights``: version -> percent; versions left out go to 0), ``promote`` (``version``
    becomes the stable one, with every request), ``rollback`` (every request to the stable
    version). Answered with a ``RolloutAnswer`` at ``reply_address``."""

    request_id: str
    reply_address: str
    action: Action
    model: str = ""
    weights: dict[str, int] = field(default_factory=dict)
    version: str = ""

    def __post_init__(self) -> None:
        _check_text(self.request_id, MAX_ID, "request_id")
        _check_text(self.reply_address, MAX_ADDRESS, "reply_address")
        if self.model or self.action != "status":
            check_name(self.model)
        check_weights(self.weights)
        if self.version and not VERSION.fullmatch(self.version):
            raise ValueError(f"version must be a version name, got {self.version!r:.80}")


@message("rollout_answer")
@dataclass(frozen=True, kw_only=True)
class RolloutAnswer(Message):
    """Coordinator → admin: the rollouts as they stand after the command (``error`` empty),
    or why it was not applied."""

    request_id: str
    error: str = ""
    rollouts: list[Rollout] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_text(self.request_id, MAX_ID, "request_id")
        _check_text(self.error, MAX_REASON, "error")
        if len(self.rollouts) > MAX_ROLLOUTS:
            raise ValueError(f"at most {MAX_ROLLOUTS} rollouts")


def format_rollout(r: Rollout) -> str:
    """``chat: v1=75 (stable) v2=25``, and the reason."""
    parts = [f"{v}={r.weights[v]}{' (stable)' if v == r.stable else ''}" for v in r.order()]
    why = f" [{r.reason}]" if r.reason else ""
    return f"{r.model}: {' '.join(parts)}{why}"
