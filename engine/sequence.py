"""A request inside the engine: its tokens, blocks, sampling state and status.

Status on the engine (each sequence is in exactly one scheduler queue)::

    reserve ─▶ WAITING_FOR_REMOTE_KVS ─KV landed: add_prefilled(_n)─▶ its blocks decode on
    add_request ─▶ WAITING ─schedule─▶ RUNNING ─stop/length─▶ FINISHED (hold_kv: KV kept,
                      ▲                   │                            until released)
                      └──── preempted ────┘   (blocks freed, recomputed later)
    abort from any state ─▶ FINISHED (finish_reason "abort")

A reservation (engine/kv_handoff.py) is a sequence WAITING_FOR_REMOTE_KVS: blocks that another
worker's KV is written into, never scheduled; when the KV has landed, the sequences that decode
from it take its blocks over and it is FINISHED.

A prompt computed once for ``n`` choices (engine/fork.py) is a sequence of its own whose
``choices`` wait outside the queues until its last logits give each its token 0; then they
enter WAITING with forked blocks (or finish there) and the prompt sequence is FINISHED.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams

# An engine request id: any hashable value (a string in tests and ``generate``; a worker's typed
# key, pdserve.protocol.keys.ChoiceKey, for one choice of a request). Never parsed.
RequestId = Hashable


class SequenceStatus(enum.Enum):
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: RequestId
    token_ids: list[int]  # prompt, then generated tokens appended in place
    params: SamplingParams
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | None = None  # the stop token id, when one ended the sequence
    # KV state
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    hold_kv: bool = False  # keep blocks after finishing (prefill worker: KV still to send)
    num_prompt_tokens: int = field(init=False, default=0)
    # Tokens handed out by earlier step() outputs (so each output carries only new ones).
    num_returned_tokens: int = 0
    # Sampler state for penalties, kept across steps (engine/sampler.py PenaltyState).
    penalty: Any = None
    # llguidance matcher of a constrained request (engine/grammar.py), advanced per token
    matcher: Any = None
    # n choices of one prompt (engine/fork.py): on the prompt's sequence, its choices until
    # their token 0 is drawn; on each such choice, that prompt's sequence
    choices: list[Sequence] | None = field(default=None, repr=False, compare=False)
    parent: Sequence | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]
