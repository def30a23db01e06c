"""Transfer fault injection, for tests and soak runs (``--kv-fault MODE[:RATE[:DELAY_S]]``).

Modes, as a receiver sees them:
- ``drop``: nothing arrives; the sender reports DONE (the bytes were "lost on the wire"), the
  receiver's transfer times out and FAILS.
- ``delay``: the transfer leaves ``delay_s`` late (past the receiver's timeout: FAILED there,
  and the late arrival is dropped).
- ``truncate``: the last layer's buffer is missing: FAILED ("layer buffers").
- ``corrupt``: one byte of the payload is flipped after the checksum was taken: FAILED
  ("checksum mismatch") where checksums are on, silently wrong KV where they are off.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Protocol

MODES = ("drop", "delay", "truncate", "corrupt")


@dataclass(frozen=True)
class FaultPlan:
    mode: str
    rate: float = 1.0  # fraction of transfers hit
    delay_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown KV fault {self.mode!r}; choose one of {', '.join(MODES)}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"KV fault rate must be in [0, 1], got {self.rate}")

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """``corrupt``, ``drop:0.25``, ``delay:1:45`` (mode, rate, delay seconds)."""
        mode, *rest = text.split(":")
        rate = float(rest[0]) if rest else 1.0
        delay = float(rest[1]) if len(rest) > 1 else 60.0
        return cls(mode, rate, delay)


class FaultableJob(Protocol):
    """What a queued job carries of its injected fault."""

    fault: str | None
    not_before: float


class FaultDice:
    """Decides, reproducibly and thread-safely, which transfers a plan hits."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()

    def hit(self) -> bool:
        with self._lock:
            return self._rng.random() < self.plan.rate

    def mark(self, job: FaultableJob) -> None:
        """Mark ``job`` with the plan's fault when the dice hit it (a delay: when it may go)."""
        if self.hit():
            job.fault = self.plan.mode
            if job.fault == "delay":
                job.not_before = time.monotonic() + self.plan.delay_s
