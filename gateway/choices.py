"""One choice of a request: token events in, text deltas out.

Events are ordered by token index (token 0 comes from the prefill worker, 1.. from the decode
worker, and may overtake it), then each token goes through the detokenizer and the stop matcher:

    events --reorder--> token ids --detokenize--> text --stop strings--> deltas for the client
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.tokenizer import Tokenizer
from gateway.backend import BackendError, TokenEvent
from gateway.detokenizer import IncrementalDetokenizer
from gateway.logprobs import LogprobEntry, TokenTexts, resolve
from gateway.stop import StopMatcher
from gateway.tools.calls import ToolCallDelta


@dataclass
class ChoiceUpdate:
    index: int  # the choice's index in the response
    text: str = ""
    num_tokens: int = 0  # tokens consumed by this update
    first: bool = False  # carries the choice's first token
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # set by gateway.tools.output


class ChoiceState:
    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
        token_texts: TokenTexts | None = None,
    ) -> None:
        """``token_texts`` turns logprobs on: they are kept only when it is given."""
        self.index = index
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, context_ids)
        self._stop = StopMatcher(stops)
        self._texts = token_texts
        self._waiting: dict[int, TokenEvent] = {}  # token events ahead of the next index
        self._end: TokenEvent | None = None  # a final event that carries no token
        self._next = 0  # index of the next token to consume
        self._text_len = 0  # characters the detokenizer has produced (logprob text offsets)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_by_stop_string = False
        self.backend_finished = False  # the backend sent this choice's final event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> ChoiceUpdate | None:
        """Take one event; return what became final, or None when nothing did."""
        if event.finish_reason is not None:
            self.backend_finished = True
        if self.finished:
            return None  # a straggler after a stop string ended the choice
        if event.index < self._next or event.index in self._waiting:
            raise BackendError(f"choice {self.index}: token index {event.index} arrived twice")
        if event.token_ids:
            self._waiting[event.index] = event
        else:
            if event.finish_reason is None:
                return None
            self._end = event
        update = ChoiceUpdate(self.index, first=self.num_tokens == 0)
        while not self.finished and self._next in self._waiting:
            self._consume(self._waiting.pop(self._next), update)
        if not self.finished and self._end is not None and self._end.index == self._next:
            self._finish(self._end.finish_reason or "stop", update)
        if update.num_tokens == 0 and update.finish_reason is None:
            return None
        return update

    def _consume(self, event: TokenEvent, update: ChoiceUpdate) -> None:
        last = len(event.token_ids) - 1
        for j, token_id in enumerate(event.token_ids):
            self._next += 1
            self.num_tokens += 1
            update.num_tokens += 1
            if self._texts is not None and event.logprobs and j < len(event.logprobs):
                entry = resolve(self._texts, token_id, event.logprobs[j], self._text_len)
                update.logprobs.append(entry)
            if j == last and event.finish_reason == "stop":
                break  # the eos / stop token id: counted, never shown
            piece = self._detok.add(token_id)
            self._text_len += len(piece)
            text, matched = self._stop.feed(piece)
            update.text += text
            if matched:
                self.stopped_by_stop_string = True
                self.finish_reason = update.finish_reason = "stop"
                return
        if event.finish_reason is not None:
            self._finish(event.finish_reason, update)

    def _finish(self, reason: str, update: ChoiceUpdate) -> None:
        piece = self._detok.flush()
        self._text_len += len(piece)
        text, matched = self._stop.feed(piece)
        update.text += text + self._stop.flush()
        self.stopped_by_stop_string = matched
        self.finish_reason = update.finish_reason = "stop" if matched else reason
