"""One choice of a request: token chunks in, text deltas out.

Chunks come in index order, each token once (the backend's contract, kept by
``gateway.reorder``: nothing is reordered here); each token goes through the detokenizer and
the stop matcher:

    chunks --token ids--> detokenize --text--> stop strings --> deltas for the client
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.backend import BackendError
from pdserve.gateway.detokenizer import IncrementalDetokenizer
from pdserve.gateway.logprobs import LogprobEntry, TokenTexts, resolve
from pdserve.gateway.stop import StopMatcher
from pdserve.gateway.tools.calls import ToolCallDelta
from pdserve.protocol.messages import TokenChunk


@dataclass
class ChoiceUpdate:
    index: int  # the choice's index in the response
    text: str = ""
    num_tokens: int = 0  # tokens consumed by this update
    first: bool = False  # carries the choice's first token
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # set by gateway.tools.output

    def absorb(self, later: ChoiceUpdate) -> None:
        """Take in the same choice's next update (one event for a reader that fell behind)."""
        self.text += later.text
        self.num_tokens += later.num_tokens
        self.finish_reason = later.finish_reason or self.finish_reason
        self.logprobs += later.logprobs
        self.tool_calls += later.tool_calls


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
        self._next = 0  # index of the next token to consume
        self._text_len = 0  # characters the detokenizer has produced (logprob text offsets)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_by_stop_string = False
        self.backend_finished = False  # the backend sent this choice's final chunk

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, chunk: TokenChunk) -> ChoiceUpdate | None:
        """Take the choice's next chunk; return what became final, or None when nothing did."""
        if chunk.finished:
            self.backend_finished = True
        if self.finished:
            return None  # a straggler after a stop string ended the choice
        if chunk.index != self._next:  # a backend that broke its contract
            raise BackendError(
                f"choice {self.index}: token index {chunk.index} came, {self._next} expected"
            )
        update = ChoiceUpdate(self.index, first=self.num_tokens == 0)
        eos = chunk.finished and chunk.finish_reason == "stop"  # the last id: counted, not shown
        last = len(chunk.token_ids) - 1
        texts, logprobs = self._texts, chunk.logprobs
        for j, token_id in enumerate(chunk.token_ids):
            self._next += 1
            self.num_tokens += 1
            update.num_tokens += 1
            if texts is not None and logprobs and j < len(logprobs):
                update.logprobs.append(resolve(texts, token_id, logprobs[j], self._text_len))
            if j == last and eos:
                break
            piece = self._detok.add(token_id)
            self._text_len += len(piece)
            text, matched = self._stop.feed(piece)
            update.text += text
            if matched:
                self.stopped_by_stop_string = True
                self.finish_reason = update.finish_reason = "stop"
                return update
        if chunk.finished:
            self._finish(chunk.finish_reason or "stop", update)
        if update.num_tokens == 0 and update.finish_reason is None:
            return None
        return update

    def _finish(self, reason: str, update: ChoiceUpdate) -> None:
        piece = self._detok.flush()
        self._text_len += len(piece)
        text, matched = self._stop.feed(piece)
        update.text += text + self._stop.flush()
        self.stopped_by_stop_string = matched
        self.finish_reason = update.finish_reason = "stop" if matched else reason
