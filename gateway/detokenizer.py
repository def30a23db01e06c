"""Incremental detokenization: text deltas whose concatenation equals ``decode(all_ids)``.

vLLM's prefix/read offsets over a sliding window of ids (what ``tokenizers.DecodeStream`` does):

    ids:  ... | prefix ......... read | new ids
              [   prefix_text       ]
              [   window_text                  ]   emitted: window_text[len(prefix_text):]

Decoding a window rather than single tokens keeps what the decoder does across token boundaries
(byte-level BPE joining bytes of one character, sentencepiece dropping the leading space of the
first token only). A window whose text ends in U+FFFD is an unfinished UTF-8 sequence: nothing is
emitted until a later token completes it (or ``flush`` at the end gives it up as is).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # prompt ids kept as left context, so the first output token decodes in place


class IncrementalDetokenizer:
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
