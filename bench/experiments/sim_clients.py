"""The bench's clients in the simulator, as ``follow`` callbacks (sim/cluster.py's closed
loop: told when a request ends, they answer with what they send then).

    Stages          pdserve bench with several rates against one server: the warm-up, then
                    each rate once everything before it is back (harness.run)
    Conversations   the multi-turn client (bench/multi_turn.py): a turn when the last answer
                    is back, a slot a conversation, the chat template's prompt lengths
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pdserve.sim.request import SimRequest
from pdserve.sim.results import Outcome


@dataclass
class Stages:
    """``pdserve bench`` with several rates against one server: the warm-up's requests at
    once, then each rate's (``stages``) once everything before it is back (the harness
    gathers a stage before it starts the next), each from the moment it starts."""

    warmup: list[SimRequest]
    stages: list[list[SimRequest]]
    stage_of: dict[int, int] = field(default_factory=dict)  # id(request) -> stage (-1: warm-up)
    sent: list[SimRequest] = field(default_factory=list)  # every one (their ids stay theirs)
    _left: int = 0
    _next: int = 0

    def first(self) -> list[SimRequest]:
        return self._send(-1, self.warmup, 0.0) if self.warmup else self._start(0.0)

    def _send(self, stage: int, requests: list[SimRequest], now: float) -> list[SimRequest]:
        sent = [dataclasses.replace(q, arrival_s=now + q.arrival_s) for q in requests]
        self.sent += sent
        self.stage_of |= {id(q): stage for q in sent}
        self._left = len(sent)
        return sent

    def _start(self, now: float) -> list[SimRequest]:
        if self._next >= len(self.stages):
            return []
        self._next += 1
        return self._send(self._next - 1, self.stages[self._next - 1], now)

    def follow(self, out: Outcome, now: float) -> list[SimRequest]:
        self._left -= 1
        return self._start(now) if self._left == 0 else []


MESSAGE_TOKENS = 5  # ChatML: <|im_start|> role \n ... <|im_end|> \n
REPLY_TOKENS = 3  # the generation prompt: <|im_start|> assistant \n


@dataclass
class Conversations:
    """bench/multi_turn.py's client in the simulator: ``warmup`` first turns (another system
    prompt) sent at once; when they are back, ``concurrency`` conversations start, each turn
    sent when the last answer is back, a conversation's slot passing to the next one when it
    ends. Prompts are the chat template's: each message its ChatML frame, answers re-sent as
    ``output`` tokens."""

    conversations: int
    turns: int
    system: int
    user: int
    output: int
    concurrency: int
    warmup: int
    where: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (conv, turn)
    _next: int = 0
    _warm_left: int = 0

    def prompt_tokens(self, turn: int) -> int:
        users = turn * (MESSAGE_TOKENS + self.user)
        answers = (turn - 1) * (MESSAGE_TOKENS + self.output)
        return MESSAGE_TOKENS + self.system + users + answers + REPLY_TOKENS

    def request(self, conv: int, turn: int, at: float) -> SimRequest:
        """Turn ``turn`` (from 1) of conversation ``conv`` (negative: a warm-up one)."""
        shared = MESSAGE_TOKENS + self.system + 3  # through the first user message's header
        prefixes: tuple[tuple[str, int], ...] = (("system" if conv >= 0 else "warm", shared),)
        if turn > 1:  # the last turn's prompt and the answer's KV (its last token never fed)
            prefixes += ((f"c{conv}t{turn - 1}", self.prompt_tokens(turn - 1) + self.output - 1),)
        key = f"c{conv}t{turn}"
        self.where[key] = (conv, turn)
        kind = "warmup" if conv < 0 else f"turn{turn}"
        return SimRequest(at, self.prompt_tokens(turn), self.output, prefixes, key, kind=kind)

    def first(self) -> list[SimRequest]:
        self._warm_left = self.warmup
        if not self.warmup:
            return self._start(0.0)
        return [self.request(-1 - i, 1, 0.0) for i in range(self.warmup)]

    def _start(self, now: float) -> list[SimRequest]:
        """The first conversations: ``concurrency`` of them."""
        count = min(self.concurrency, self.conversations)
        self._next = count
        return [self.request(c, 1, now) for c in range(count)]

    def follow(self, out: Outcome, now: float) -> list[SimRequest]:
        conv, turn = self.where[out.req.key or ""]
        if conv < 0:
            self._warm_left -= 1
            return self._start(now) if self._warm_left == 0 else []
        if not out.failed and turn < self.turns:
            return [self.request(conv, turn + 1, now)]
        if self._next < self.conversations:
            self._next += 1
            return [self.request(self._next - 1, 1, now)]
        return []
