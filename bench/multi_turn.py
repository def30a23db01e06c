"""The multi-turn chat workload: ``conversations`` conversations of ``turns`` turns each, all
opening with one shared system prompt. Each turn re-sends the whole history, as a chat client
does: the system prompt, every earlier user message and the assistant's actual answer to it,
then a new user message. A conversation's next turn starts only once the previous answer is
back (and ``think_time`` seconds later)::

    turn 1   [system][user 1]
    turn 2   [system][user 1][answer 1][user 2]
    turn 3   [system][user 1][answer 1][user 2][answer 2][user 3]

Conversation starts follow the run's arrival process (``--request-rate``, ``inf``: all at
once); at most ``max_concurrency`` conversations are in flight, each holding its slot from its
first turn to its last, think time included. A failed turn ends its conversation (there is no
answer to go on with). The system prompt and user messages come from the seed; the answers from
the server. Any OpenAI-compatible chat endpoint serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any  # chat messages are JSON, sent as they are

import httpx
import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import Target, send
from pdserve.bench.datasets import BenchRequest, lengths
from pdserve.bench.metrics import RequestOutput
from pdserve.bench.prompts import PromptMaker
from pdserve.bench.report import Progress
from pdserve.bench.runner import RunSpec


@dataclass(frozen=True)
class MultiTurnSpec:
    conversations: int = 32
    turns: int = 4
    system_len: int = 512  # tokens of the shared system prompt; 0: none
    user_len: int = 64  # tokens of each user message
    output_len: int = 64  # max_tokens of each answer
    range_ratio: float = 0.0  # user and output lengths uniform in len·(1 ± ratio)
    think_time: float = 0.0  # seconds between an answer and the conversation's next turn

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "user_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"multi-turn {name} must be at least 1, got {getattr(self, name)}")
        if self.system_len < 0:
            raise ValueError(f"multi-turn system_len must be >= 0, got {self.system_len}")
        if self.think_time < 0:
            raise ValueError(f"multi-turn think_time must be >= 0, got {self.think_time}")


@dataclass(frozen=True)
class Conversation:
    """Everything of a conversation but the answers: those come back at run time."""

    system: str
    system_len: int
    users: tuple[str, ...]  # one user message per turn
    user_lens: tuple[int, ...]
    max_tokens: tuple[int, ...]


def build_conversations(
    maker: PromptMaker, spec: MultiTurnSpec, rng: np.random.Generator
) -> list[Conversation]:
    """``spec.conversations`` conversations sharing one system prompt; deterministic in
    ``rng``'s seed."""
    system = maker.text(spec.system_len, rng) if spec.system_len else ""
    convs = []
    for _ in range(spec.conversations):
        user_lens = lengths(rng, spec.turns, spec.user_len, spec.range_ratio)
        outs = lengths(rng, spec.turns, spec.output_len, spec.range_ratio)
        users = tuple(maker.text(n, rng) for n in user_lens)
        convs.append(Conversation(system, spec.system_len, users, tuple(user_lens), tuple(outs)))
    return convs


def turn_messages(conv: Conversation, answers: list[str]) -> list[dict[str, Any]]:
    """The messages of turn ``len(answers) + 1``: the history so far and the next user message."""
    if len(answers) >= len(conv.users):
        raise ValueError(f"a {len(conv.users)}-turn conversation has no turn {len(answers) + 1}")
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    for user, answer in zip(conv.users, answers, strict=False):
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": conv.users[len(answers)]})
    return messages


def turn_request(conv: Conversation, answers: list[RequestOutput]) -> BenchRequest:
    """The next turn's request; ``prompt_len`` (used only where the server reports no usage)
    counts the system prompt, the user messages and the answers' output tokens."""
    turn = len(answers) + 1
    prompt_len = conv.system_len + sum(conv.user_lens[:turn])
    prompt_len += sum(a.output_tokens for a in answers)
    return BenchRequest(
        "",
        conv.max_tokens[turn - 1],
        prompt_len,
        messages=tuple(turn_messages(conv, [a.generated_text for a in answers])),
        kind="multi-turn",
        turn=turn,
    )


async def run_conversations(
    client: httpx.AsyncClient,
    target: Target,
    conversations: list[Conversation],
    spec: RunSpec,
    think_time: float = 0.0,
    progress: Progress | None = None,
) -> tuple[list[RequestOutput], float]:
    """Every turn's output (in send order) and the run's duration. No turn starts after
    ``spec.duration`` seconds; what is in flight then is waited for."""
    if not target.chat:
        raise ValueError("--dataset multi-turn needs --endpoint /v1/chat/completions")
    rng = np.random.default_rng(spec.seed)
    starts = arrival_offsets(len(conversations), spec.rate, spec.burstiness, rng)
    slots = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    t0 = time.perf_counter()

    def expired() -> bool:
        return spec.duration is not None and time.perf_counter() - t0 >= spec.duration

    async def converse(at: float, conv: Conversation) -> list[RequestOutput]:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        answers: list[RequestOutput] = []
        async with slots if slots else contextlib.nullcontext():
            for turn in range(len(conv.users)):
                if turn and think_time:
                    await asyncio.sleep(think_time)
                if expired():
                    break
                out = await send(client, target, turn_request(conv, answers), t0)
                answers.append(out)
                if progress:
                    progress.finished(out)
                if not out.success:
                    break
        return answers

    if progress:
        progress.start(t0, sum(len(c.users) for c in conversations))
    pairs = zip(starts, conversations, strict=True)
    tasks = [asyncio.create_task(converse(at, conv)) for at, conv in pairs]
    outputs = [out for outs in await asyncio.gather(*tasks) for out in outs]
    duration = time.perf_counter() - t0
    outputs.sort(key=lambda o: o.start_time)
    if progress:
        progress.all_sent(len(outputs))
        progress.close()
    return outputs, duration
