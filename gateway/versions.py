"""Which version of a model a request gets: the coordinator's rollout table (``ClusterState.
rollouts``, ``protocol.rollouts``) applied per conversation.

A request for ``NAME`` (a name with versions) is resolved once, when it arrives, to one
``NAME@VERSION``: a served model of its own, which the request keeps to its end whatever the
weights become (a stream in flight finishes on its version). The choice is a stable hash of
the tenant and the conversation's opening (``conversation_pin``), laid over the versions'
shares, stable version first::

    hash(tenant, opening) -> u in [0, 100)      v1=75 (stable)     v2=25
                                                [0 ............ 75)[75 ... 100)

so every turn of one chat lands on the same version (its prefix cache holds) while the weights
stand, and a canary that grows takes conversations only from the stable version's end. A
request for ``NAME@VERSION`` goes to that version directly. Responses name the version that
served them (``model``: ``chat@v2``), as OpenAI answers ``gpt-4o`` with its dated snapshot.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from pdserve.gateway.observe.prometheus import Counter, Gauge, Registry
from pdserve.protocol.rollouts import Rollout, split_version

PIN_PROMPT_CHARS = 256  # a completion prompt's opening: its first characters (or token ids)
PIN_MAX_CHARS = 16_384  # what is hashed of a chat's opening, at most


def conversation_pin(body: BaseModel, tenant: str) -> bytes:
    """What keeps a conversation on one version: its tenant, and its opening as every later
    turn repeats it. A chat's messages up to its first user message (the system prompt and
    the first question); a completion's first ``PIN_PROMPT_CHARS`` characters (a conversation
    whose first turn is shorter may move between versions between turns); a Responses API
    request's instructions and input up to its first user item."""
    opening: Any
    if hasattr(body, "messages"):
        messages = body.messages
        first = next((i for i, msg in enumerate(messages) if msg.role == "user"), 0)
        opening = [msg.model_dump(mode="json", include={"role", "content"}) for msg in messages]
        opening = opening[: first + 1]
    elif hasattr(body, "prompt"):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: the first prompt's conversation
        opening = prompt[:PIN_PROMPT_CHARS]
    else:
        dumped = body.model_dump(mode="json", include={"instructions", "input"})
        items = dumped.get("input")
        if isinstance(items, list):
            first = next((i for i, it in enumerate(items) if _role(it) == "user"), 0)
            dumped["input"] = items[: first + 1]
        opening = dumped
    text = json.dumps(opening, sort_keys=True, ensure_ascii=False)[:PIN_MAX_CHARS]
    return f"{tenant}\0{text}".encode()


def _role(item: object) -> object:
    return item.get("role") if isinstance(item, dict) else None


def choose(rollout: Rollout, pin: bytes) -> str:
    """The served name (``NAME@VERSION``) whose share ``pin``'s hash falls in."""
    point = int.from_bytes(hashlib.sha256(pin).digest()[:8], "big") * 100 / 2**64  # [0, 100)
    upper = 0
    for version in rollout.order():
        upper += rollout.weights[version]
        if point < upper:
            return rollout.served(version)
    return rollout.served(rollout.stable)  # weights the coordinator never sends: short of 100


class Versions:
    """The rollouts as the coordinator last said (``rollouts``: the backend's), asked per
    request: which version a name stands for, and whether a served name is a version."""

    def __init__(self, rollouts: Callable[[], list[Rollout]]) -> None:
        self._rollouts = rollouts

    def pick(self, name: str, pin: Callable[[], bytes] | None) -> str:
        """``name``'s version for the conversation ``pin`` gives the key of (None: its stable
        version: no conversation, e.g. ``/tokenize``); a name without versions as it is."""
        rollout = next((r for r in self._rollouts() if r.model == name), None)
        if rollout is None:
            return name
        return rollout.served(rollout.stable) if pin is None else choose(rollout, pin())

    def declared(self, served: str) -> bool:
        """Whether ``served`` is a version some rollout names (workers or not yet)."""
        parts = split_version(served)
        return parts is not None and any(
            r.model == parts[0] and parts[1] in r.weights for r in self._rollouts()
        )

    def names(self) -> dict[str, str]:
        """Each name with versions -> its stable version's served name (its model card's)."""
        return {r.model: r.served(r.stable) for r in self._rollouts()}


def rollout_metrics(rollouts: list[Rollout]) -> str:
    """``pdserve_rollout_weight`` and ``pdserve_rollout_rollbacks_total``, as the coordinator
    last reported them, in the exposition format."""
    registry = Registry()
    weight = registry.add(
        Gauge(
            "pdserve_rollout_weight",
            "Percent of a model name's requests each of its versions takes (the request "
            "metrics' model label is NAME@VERSION).",
            ["model", "version"],
        )
    )
    rollbacks = registry.add(
        Counter(
            "pdserve_rollout_rollbacks_total",
            "Times the canary gate rolled a model name's canary back.",
            ["model"],
        )
    )
    for r in rollouts:
        for version in r.order():
            weight.set(r.weights[version], model=r.model, version=version)
        rollbacks.inc(r.gate_rollbacks, model=r.model)
    return registry.render() if rollouts else ""
