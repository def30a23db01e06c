"""A request's state as it moves through the simulated workers (one ``Seq`` a request), and a
prompt job: prompt tokens a worker has still to compute for it."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.sim.results import Outcome


class Seq:
    """``emitted``: tokens the gateway has (token 0 included); on a decode worker ``join`` is
    the worker's step at which it joined the batch and ``context0`` the tokens whose KV it held
    then (the next step writes position ``context0``)."""

    __slots__ = ("context0", "emitted", "epoch", "join", "order", "out")

    def __init__(self, out: Outcome, order: int) -> None:
        self.out = out
        self.emitted = 0
        self.join = 0
        self.context0 = 0
        self.epoch = 0  # bumped when it leaves a batch (a heap entry of an older epoch is stale)
        self.order = order  # arrival order (ties, victims)

    @property
    def tier(self) -> int:
        return self.out.req.tier

    @property
    def left(self) -> int:
        """Output tokens it has still to emit."""
        return self.out.req.output_tokens - self.emitted

    def emit(self, t: float, record: bool) -> None:
        """One more token at the gateway at ``t``."""
        out = self.out
        if self.emitted == 0:
            out.t_first = t
        elif record:
            if out.gaps is None:
                out.gaps = []
            out.gaps.append(t - (out.t_last or t))
        out.t_last = t
        self.emitted += 1
        out.tokens = self.emitted


@dataclass
class PromptJob:
    """``tokens`` to compute (what no cache held), ``done`` so far; ``blocks`` held for it on
    the worker; ``since``: when it was queued (its age, for the overdue rule)."""

    seq: Seq
    tokens: int
    blocks: int
    since: float
    done: int = 0
    overdue: bool = False
    recompute: bool = False  # a preempted stream computing its tokens again

    @property
    def remaining(self) -> int:
        return self.tokens - self.done
