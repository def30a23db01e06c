"""One choice of a request: token chunks in, text deltas out.

Chunks come in index order, each token once (the backend's contract, kept by
``gateway.token_streams.ChoiceOrder``: nothing is reordered here); each token goes through the
detokenizer and the stop matcher:

    chunks --token ids--> IncrementalDetokenizer --text--> StopMatcher --> deltas for the client

``ChoiceState`` owns one choice's progress and finish; ``IncrementalDetokenizer`` turns its ids
into text; ``StopMatcher`` holds back what may be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.backend import BackendError
from pdserve.gateway.logprobs import LogprobEntry, TokenTexts, resolve
from pdserve.gateway.tools.calls import ToolCallDelta
from pdserve.protocol.messages import TokenChunk, TokenLogprob

_REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # prompt ids kept as left context, so the first output token decodes in place


@dataclass
class ChoiceUpdate:
    index: int  # the choice's index in the response
    text: str = ""
    num_tokens: int = 0  # tokens consumed by this update
    first: bool = False  # carries the choice's first token
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # set by responses.ToolOutput
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token, when asked for

    def absorb(self, later: ChoiceUpdate) -> None:
        """Take in the same choice's next update (one event for a reader that fell behind)."""
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.text += later.text
        self.num_tokens += later.num_tokens
        self.finish_reason = later.finish_reason or self.finish_reason
        self.logprobs += later.logprobs
        self.tool_calls += later.tool_calls


class ChoiceState:
    """One choice's text state: its detokenizer and stop matcher, the next token index it
    expects, its token count, and how it finished."""

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
        update.prompt_logprobs = chunk.prompt_logprobs
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


class IncrementalDetokenizer:
    """Text deltas whose concatenation equals ``decode(all_ids)``.

    vLLM's prefix/read offsets over a sliding window of ids (what ``tokenizers.DecodeStream``
    does)::

        ids:  ... | prefix ......... read | new ids
                  [   prefix_text       ]
                  [   window_text                  ]   emitted: window_text[len(prefix_text):]

    Decoding a window rather than single tokens keeps what the decoder does across token
    boundaries (byte-level BPE joining bytes of one character, sentencepiece dropping the
    leading space of the first token only). A window whose text ends in U+FFFD is an
    unfinished UTF-8 sequence: nothing is emitted until a later token completes it (or
    ``flush`` at the end gives it up as is)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ) -> None:
        """``context_ids`` (the prompt's tail) is decoded as left context and never emitted."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it makes final (often "", never a partial char)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back (an unfinished UTF-8 sequence), decoded as it stands."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        window_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return window_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


class StopMatcher:
    """Stop strings matched across token boundaries.

    Text that could be the start of a stop string is held back until the next text proves it
    is not; the client never sees a stop string or anything after it (OpenAI semantics)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Take new text; return (text safe to emit now, whether a stop string matched).

        After a match the matcher is done: later calls return ("", True)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text, for a choice that ended for another reason."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest
