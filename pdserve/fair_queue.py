"""The fair queue that waiting work is taken from: the coordinator's choices waiting for
decode blocks (coordinator/routes.py) and an engine's waiting sequences (engine/scheduler.py).
Pure: no clock, no I/O; it sits at the namespace's root because both import it and neither
may import the other (tests/test_layering.py), and it is no wire type for ``protocol``.

Which item comes out next (each item has a ``Share``, protocol/tenancy.py, and a cost)::

    1. put back      an item ``push_front`` put back (preempted, or due again next step):
                     the last one put back first, ahead of everything, charged nothing
    2. tier          PREMIUM, then STANDARD, then BATCH: a higher tier's waiting item is
                     always taken before a lower one's
    3. tenant        within a tier, start-time fair queueing on tokens between its tenants,
                     weighted by ``Share.weight`` (below)
    4. the tenant's  by (``Share.priority``, arrival): lower priority first, as vLLM's
       own items     ``priority`` policy

Within a tier every tenant with items waiting gets tokens in proportion to its weight, as
with deficit round robin (and, like it, within one item's cost of its exact share), but with
no quantum to tune and a ``peek`` that changes nothing::

    clock      v    the start tag of the tier's last item taken
    tenant t   F_t  where its service so far ends, in tokens / weight (0 when first seen)
    next            the tenant with the least start, max(F_t, v); a tie goes to the tenant
                    whose next item arrived first
    taking          an item of cost c, weight w:  start = max(F_t, v);  F_t = start + c / w;
                    v = start

A tenant cannot bank time while it has nothing waiting (its start is at least ``v``), and one
that arrives behind another's long backlog is next but for ties: its start is ``v``, below
the backlogged tenant's ``F``. When a tier has nothing left its tags are forgotten (a busy
period ended). Tags are ``Fraction``s: ties are exact, so the order is too. What an item costs
is its caller's choice (both callers: the prompt tokens it has to compute, at least 1).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Generic, TypeVar

from pdserve.protocol.tenancy import DEFAULT, Share, Tier

T = TypeVar("T")
_ZERO = Fraction(0)
_HIGHEST_FIRST = sorted(Tier, reverse=True)


@dataclass(slots=True, eq=False)  # entries are told apart by identity (their items may be
class _Entry(Generic[T]):  # anything: comparing them could be costly, or an error)
    item: T
    share: Share
    cost: int
    arrival: int
    front: bool = False  # put back (``push_front``): its share and cost play no part

    def order(self) -> tuple[int, int]:
        """Its place among its tenant's items."""
        return self.share.priority, self.arrival


@dataclass
class _TierQueue(Generic[T]):
    """One tier: its tenants' waiting items, their finish tags and the tier's clock."""

    clock: Fraction = _ZERO
    finish: dict[str, Fraction] = field(default_factory=dict)  # tenants of this busy period
    waiting: dict[str, list[_Entry[T]]] = field(default_factory=dict)  # by (priority, arrival)

    def start(self, tenant: str) -> Fraction:
        return max(self.finish.get(tenant, _ZERO), self.clock)

    def head(self) -> _Entry[T] | None:
        """The next item of the tenant with the least start tag (ties: earliest arrival)."""
        best: tuple[Fraction, int] | None = None
        chosen = None
        for tenant, entries in self.waiting.items():
            rank = (self.start(tenant), entries[0].arrival)
            if best is None or rank < best:
                best, chosen = rank, entries[0]
        return chosen

    def take(self, entry: _Entry[T]) -> None:
        """``entry`` (a tenant's head) leaves, its cost charged to its tenant."""
        tenant, weight = entry.share.tenant, Fraction(entry.share.weight)
        start = self.start(tenant)
        self.finish[tenant] = start + Fraction(entry.cost) / weight
        self.clock = start
        self.discard(entry)
        # a tenant with nothing waiting whose tag the clock has passed starts at the clock
        # anyway: forgetting it changes nothing and bounds the table
        for idle in [t for t, f in self.finish.items() if t not in self.waiting and f <= start]:
            del self.finish[idle]

    def discard(self, entry: _Entry[T]) -> None:
        """``entry`` leaves uncharged; an empty tier forgets its tags."""
        tenant = entry.share.tenant
        entries = self.waiting[tenant]
        entries.remove(entry)
        if not entries:
            del self.waiting[tenant]
        if not self.waiting:
            self.clock, self.finish = _ZERO, {}


class FairQueue(Generic[T]):
    """Items waiting for capacity, taken in tier, fair-share and priority order (module
    docstring). An item is in it at most once; it is found again by identity, not equality."""

    def __init__(self) -> None:
        self._front: list[_Entry[T]] = []  # put back: the last one first
        self._tiers: dict[Tier, _TierQueue[T]] = {tier: _TierQueue() for tier in Tier}
        self._entries: dict[int, _Entry[T]] = {}  # id(item) -> its entry
        self._arrivals = itertools.count()
        self._next: _Entry[T] | None = None  # the head, until the queue changes

    def push(self, item: T, share: Share, cost: int) -> None:
        """``item`` waits behind what ``share`` orders ahead of it; taking it charges its
        tenant ``cost`` tokens (at least 1)."""
        entry = _Entry(item, share, max(int(cost), 1), next(self._arrivals))
        self._add(entry)
        entries = self._tiers[share.tier].waiting.setdefault(share.tenant, [])
        bisect.insort(entries, entry, key=_Entry.order)

    def push_front(self, item: T) -> None:
        """``item`` comes out next, ahead of everything (and of what was put back before)."""
        entry = _Entry(item, DEFAULT, 0, next(self._arrivals), front=True)
        self._add(entry)
        self._front.append(entry)

    def peek(self) -> T:
        """The item ``pop`` would take; ``IndexError`` when empty."""
        return self._head().item

    def pop(self) -> T:
        """Take the next item (charging its tenant); ``IndexError`` when empty."""
        entry = self._head()
        del self._entries[id(entry.item)]
        self._next = None
        if entry.front:
            self._front.pop()
        else:
            self._tiers[entry.share.tier].take(entry)
        return entry.item

    def remove(self, item: T) -> bool:
        """Take ``item`` out wherever it waits, uncharged (aborted); False: it was not here."""
        entry = self._entries.pop(id(item), None)
        if entry is None:
            return False
        self._next = None
        if entry.front:
            self._front.remove(entry)
        else:
            self._tiers[entry.share.tier].discard(entry)
        return True

    def newest_below(self, tier: Tier) -> T | None:
        """The item to refuse first so that one of ``tier`` may wait: the newest of the lowest
        tier below it that has any (never one put back); None when there is none."""
        for lower in sorted(Tier):
            if lower >= tier:
                return None
            waiting = self._tiers[lower].waiting
            if waiting:
                newest = max((e for es in waiting.values() for e in es), key=lambda e: e.arrival)
                return newest.item
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, item: object) -> bool:
        return id(item) in self._entries

    def __iter__(self) -> Iterator[T]:
        """Every item: those put back (next first), then each tier from the highest, each
        tenant's in its own order; across tenants this is not the order of service."""
        yield from (e.item for e in reversed(self._front))
        for tier in _HIGHEST_FIRST:
            for entries in self._tiers[tier].waiting.values():
                yield from (e.item for e in entries)

    def _add(self, entry: _Entry[T]) -> None:
        if id(entry.item) in self._entries:
            raise ValueError(f"{entry.item!r:.80} is queued already")
        self._entries[id(entry.item)] = entry
        self._next = None

    def _head(self) -> _Entry[T]:
        """The next entry (kept until the queue changes: a caller that peeks each tick while
        nothing fits scans the tenants once)."""
        if self._next is not None:
            return self._next
        if self._front:
            self._next = self._front[-1]
            return self._next
        for tier in _HIGHEST_FIRST:
            head = self._tiers[tier].head()
            if head is not None:
                self._next = head
                return head
        raise IndexError("the queue is empty")
