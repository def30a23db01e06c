"""Who a request is for, as it travels: its tenant's tier and weight and the request's own
priority (``Share``). The gateway makes it from the tenant the API key belongs to
(gateway/tenancy/tenants.py) and the request's ``priority``; the coordinator's queue and each
worker's scheduler order their waiting work by it (``pdserve.fair_queue``).

    gateway ── Generate.share ─▶ coordinator ── Reserve.share, PrefillJob.share ─▶ workers
             ─▶ engine (``Sequence.share``, read by the scheduler's waiting queue)

A request without one (``share=None``: no tenants file, an older caller) is ``DEFAULT``'s.
Like ``SamplingParams``, a ``Share`` is valid or not made at all: construction raises
``ValueError`` naming the field, which the codec turns into a ``ProtocolError`` on decode.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # as a tenants file's [tenants.NAME]
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e3  # fair shares between 1:1 and 1:1e6
# vLLM's priority is an unbounded int; a 32-bit one orders any sane use and keeps the
# number a peer can send small
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


@functools.total_ordering
class Tier(enum.Enum):
    """Priority class, ordered: ``PREMIUM > STANDARD > BATCH``."""

    BATCH = "batch"
    STANDARD = "standard"
    PREMIUM = "premium"

    @property
    def rank(self) -> int:
        return list(Tier).index(self)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Tier):
            return NotImplemented
        return self.rank < other.rank


@dataclass(frozen=True, kw_only=True)
class Share:
    """What a queue needs of a request: its tenant (who shares a tier's capacity with whom),
    the tenant's tier (a higher one's waiting work is always taken first) and weight (its
    share of the tier, against the other tenants'), and the request's ``priority`` within its
    tenant's queue (vLLM's: lower first, ties by arrival)."""

    tenant: str
    tier: Tier
    weight: float
    priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not TENANT_NAME.fullmatch(self.tenant):
            reason = "tenant must be 1 to 64 of A-Z a-z 0-9 _ . -"
            raise ValueError(f"{reason}, got {self.tenant!r:.80}")
        if not isinstance(self.tier, Tier):
            raise ValueError(f"tier must be a Tier, got {self.tier!r:.80}")
        weight = self.weight
        if type(weight) not in (int, float) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            bounds = f"{MIN_WEIGHT:g} to {MAX_WEIGHT:g}"
            raise ValueError(f"weight must be a number from {bounds}, got {weight!r:.80}")
        priority = self.priority
        if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            bounds = f"{MIN_PRIORITY} to {MAX_PRIORITY}"
            raise ValueError(f"priority must be an integer from {bounds}, got {priority!r:.80}")


DEFAULT = Share(tenant="default", tier=Tier.STANDARD, weight=1)


def share_of(share: Share | None) -> Share:
    """A message's ``share``, ``DEFAULT`` where it has none."""
    return DEFAULT if share is None else share
