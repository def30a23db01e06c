"""A decode worker's record of one choice of a request, the states it goes through, and the
policy that decides where it goes when its KV transfer fails."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey
from pdserve.protocol.tenancy import DEFAULT, Share, share_of


class DecodeState(enum.Enum):
    """Where a choice is on a decode worker (decode/worker.py draws the transitions)."""

    RESERVED = "reserved"  # blocks reserved, the receiver expects the prompt's KV
    RECEIVING = "receiving"  # the prefill worker pushed it (TransferDone): until it has landed
    RUNNING = "running"  # decoding in the engine
    # exits: the record has left the table
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


PENDING = (DecodeState.RESERVED, DecodeState.RECEIVING)  # waiting for the prompt's KV


class KVFailurePolicy(enum.StrEnum):
    """When a choice's KV transfer fails (``--kv-failure-policy``): compute its prompt and
    token 0 here instead (RUNNING), or end the request with an error (FAILED)."""

    RECOMPUTE = "recompute"
    FAIL = "fail"


@dataclass
class DecodeRecord:
    """One choice; until it decodes, the ``choices`` from it on that share its reservation
    (one prompt moved here, forked into each when the KV has landed)."""

    request_id: str
    choice: int
    prompt_token_ids: list[int]
    sampling: m.SamplingParams
    stream_address: str
    choices: int = 1
    state: DecodeState = DecodeState.RESERVED
    first_tokens: list[int] = field(default_factory=list)  # token 0 of each
    reserved_at: float = field(default_factory=time.monotonic)
    first_logprobs: list[m.TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill worker found in its prefix cache
    num_local_cached_tokens: int = 0  # prompt tokens whose KV this worker held already
    dropped: set[int] = field(default_factory=set)  # choices not to decode (ended, aborted)
    share: Share = DEFAULT  # who it is for: the order it waits in the engine
    trace: str = ""  # its trace context (``Reserve.trace``, ``PrefillJob.trace``)
    # its phases (protocol/phases.py): the coordinator's and the prefill worker's, passed on
    # with its first token; run here, when its prompt came and began computing; when its
    # first decode step began to count (the KV handed over, or token 0 here)
    carried: dict[str, float] = field(default_factory=dict)
    prompt_at: float | None = None
    computing: float | None = None
    decode_from: float | None = None

    @classmethod
    def of(cls, msg: m.Reserve | m.PrefillJob) -> DecodeRecord:
        """The choices a ``Reserve`` or a ``PrefillJob`` asks this worker to hold or run."""
        return cls(
            request_id=msg.request_id,
            choice=msg.choice,
            prompt_token_ids=msg.prompt_token_ids,
            sampling=msg.sampling,
            stream_address=msg.stream_address,
            choices=max(msg.choices, 1),
            share=share_of(msg.share),
            trace=msg.trace,
            carried=dict(msg.phases) if isinstance(msg, m.PrefillJob) else {},
            prompt_at=(
                time.monotonic()
                if isinstance(msg, m.PrefillJob) and not msg.generated_token_ids
                else None
            ),
        )

    @property
    def key(self) -> ChoiceKey:
        return ChoiceKey(self.request_id, self.choice)

    def first_of(self, choice: int) -> tuple[int, m.TokenLogprob | None]:
        """Token 0 of ``choice`` (one of these), and its logprob when asked for."""
        i = choice - self.choice
        return self.first_tokens[i], self.first_logprobs[i] if self.first_logprobs else None

    def going(self) -> list[int]:
        """The choices that decode here, in order."""
        members = range(self.choice, self.choice + self.choices)
        return [c for c in members if c not in self.dropped]

    def one(self, choice: int) -> DecodeRecord:
        """Choice ``choice`` of these on its own, as it runs."""
        return DecodeRecord(
            request_id=self.request_id,
            choice=choice,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            stream_address=self.stream_address,
            state=DecodeState.RUNNING,
            share=self.share,
            reserved_at=self.reserved_at,
            trace=self.trace,
            carried=self.carried,
            prompt_at=self.prompt_at,
            computing=self.computing,
            decode_from=self.decode_from,
        )
