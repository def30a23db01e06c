"""A choice's token chunks in index order, each token once: the one place the gateway reorders.

Chunks reach the gateway from two senders per choice (token 0 from the prefill worker, 1.. from
the decode worker) and, after a migration, from a new decode worker that may repeat what the
dead one sent; so a chunk may come before one with a lower index, twice, or after the end::

    arrives     [3,4]  [1,2]  [0]                [1,2]   [5 final]  [6]
    passed on   -      -      [0] [1,2] [3,4]    -       [5 final]  -
                held   held   the gap fills      repeat  the end    after the end

    (a chunk drawn as its token indices)

Why here, and only here: it is a backend's job (``gateway.backend`` states the contract: each
choice's chunks in index order, every token once, one final chunk), because only the backend
knows what a repeat is: it resumes a migrated choice after the tokens released so far
(``token_ids``) and drops the held ones the new worker sends again (``restart``). Every backend,
the ZMQ client and the tests' fake alike, runs its chunks through ``ChoiceOrder``, so the
per-choice text state (``gateway.choices``) only checks the order and never buffers.
"""

from __future__ import annotations

from pdserve.protocol.messages import TokenChunk


class ChoiceOrder:
    """One choice's chunks in, the chunks ready to pass on out, in index order.

    A chunk is passed on whole or not at all: one that starts before the next index (a repeat)
    is dropped, one that starts after it is held until the gap fills. Nothing is passed on after
    the final chunk. A gap never filled holds its chunks until the stream ends or fails: the
    caller's timeouts (stream idle, request) end such a choice."""

    __slots__ = ("done", "held", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []  # passed on so far, in order
        self.held: dict[int, TokenChunk] = {}  # index -> chunk, ahead of the next index
        self.done = False  # the final chunk was passed on

    def push(self, chunk: TokenChunk) -> list[TokenChunk]:
        """The chunks ready now, in order (often ``[chunk]``; empty while a gap is open)."""
        index, ids = chunk.index, self.token_ids
        if self.done or index < len(ids) or not (chunk.token_ids or chunk.finished):
            return []  # after the end, a repeat, or nothing to pass on
        if index > len(ids):
            self.held.setdefault(index, chunk)  # the first to come stays: a repeat is dropped
            return []
        ids += chunk.token_ids
        self.done = chunk.finished
        if not self.held:
            return [chunk]
        ready = [chunk]
        while not self.done and (nxt := self.held.pop(len(ids), None)) is not None:
            ids += nxt.token_ids
            self.done = nxt.finished
            ready.append(nxt)
        if self.done:
            self.held.clear()
        elif self.held:  # chunks a longer one overlapped: repeats now
            self.held = {i: c for i, c in self.held.items() if i > len(ids)}
        return ready

    def restart(self) -> None:
        """The choice moves to another worker, which sends again everything after
        ``token_ids``: what is held is dropped."""
        self.held.clear()
