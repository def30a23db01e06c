"""One choice of a request on a decode worker, from its reservation until it decodes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.protocol import messages as m


@dataclass
class Choice:
    """One choice; until it decodes, the ``choices`` from it on that share its reservation
    (one prompt moved here, forked into each when the KV has landed)."""

    request_id: str
    choice: int
    prompt_token_ids: list[int]
    sampling: m.SamplingParams
    stream_address: str
    choices: int = 1
    first_tokens: list[int] = field(default_factory=list)  # token 0 of each
    reserved_at: float = field(default_factory=time.monotonic)
    first_logprobs: list[m.TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill worker found in its prefix cache
    num_local_cached_tokens: int = 0  # prompt tokens whose KV this worker held already
    dropped: set[int] = field(default_factory=set)  # choices not to decode (ended, aborted)

    @classmethod
    def of(cls, msg: m.Reserve | m.PrefillJob) -> Choice:
        """The choices a ``Reserve`` or a ``PrefillJob`` asks this worker to hold or run."""
        return cls(
            msg.request_id,
            msg.choice,
            msg.prompt_token_ids,
            msg.sampling,
            msg.stream_address,
            max(msg.choices, 1),
        )

    def matches(self, request_id: str, choice: int | None) -> bool:
        """Whether an abort of ``request_id`` (``choice``: one of its choices, None: all)
        names this one."""
        return self.request_id == request_id and (choice is None or self.choice == choice)

    def going(self) -> list[int]:
        """The choices that decode here, in order."""
        members = range(self.choice, self.choice + self.choices)
        return [c for c in members if c not in self.dropped]

    def one(self, choice: int) -> Choice:
        """Choice ``choice`` of these on its own, as it runs."""
        return Choice(
            self.request_id, choice, self.prompt_token_ids, self.sampling, self.stream_address
        )
