"""A prefill worker's record of one job (a prompt run for one choice, or once for several),
and the states it goes through."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.engine import RequestOutput
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey
from pdserve.worker.wire import PromptKey, transfer_id


class PrefillState(enum.Enum):
    """Where a job is on a prefill worker (prefill/worker.py draws the transitions)."""

    COMPUTING = "computing"  # the prompt runs in the engine (chunked); token 0s arriving
    SENDING = "sending"  # every token 0 is out; the KV is being pushed
    # exits: the record has left the table
    DONE = "done"  # TransferDone sent, or every choice ended at token 0
    FAILED = "failed"  # the push could not start
    ABORTED = "aborted"


@dataclass
class PrefillRecord:
    """One job: its choices' token 0s so far, then its transfer (started when, reported yet)."""

    job: m.PrefillJob
    state: PrefillState = PrefillState.COMPUTING
    firsts: dict[int, RequestOutput] = field(default_factory=dict)  # token 0s, by choice
    done: m.TransferDone | None = None  # what the coordinator is told when the push ends
    transfer_started: float = 0.0  # time.monotonic() when the push began
    reported: bool = False  # ``done`` has gone out (from either thread)
    # the engine ids of its choices, from the job's first choice on
    group: tuple[ChoiceKey, ...] = field(init=False)

    def __post_init__(self) -> None:
        first = self.job.choice
        members = range(first, first + max(self.job.choices, 1))
        self.group = tuple(ChoiceKey(self.job.request_id, c) for c in members)

    @property
    def key(self) -> ChoiceKey:
        return self.group[0]

    @property
    def held_id(self) -> ChoiceKey | PromptKey:
        """The engine id whose KV is held for the transfer: the choice's, or the prompt's
        that its choices share."""
        if self.job.choices > 1:
            return PromptKey(self.job.request_id, self.job.choice)
        return self.key

    @property
    def transfer_id(self) -> str:
        return transfer_id(self.key)
