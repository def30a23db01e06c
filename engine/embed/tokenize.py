"""Text → token ids for an embedding model, as sentence-transformers tokenizes it; torch-free
(a gateway may count or check tokens with it).

The model's tokenizer.json runs as it is (normalizer, pre-tokenizer, and the post-processor
that adds [CLS]/[SEP], or a decoder's bos/eos), except for the padding and truncation it may
carry: sentence-transformers' call sets both per call (no padding here: the batch is packed;
truncation to ``max_seq_len`` only when asked). all-MiniLM-L6-v2's tokenizer.json, for one,
pads and truncates to 128 tokens, where sentence-transformers takes 256.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import normalizers


class InputTooLongError(ValueError):
    """An input with more tokens than the model takes, truncation not asked for."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"input {index} has {tokens} tokens, more than the {limit} this model takes "
            "(special tokens included); shorten it or ask for truncation"
        )
        self.index, self.tokens, self.limit = index, tokens, limit


class EmbedTokenizer:
    """One tokenizer.json, twice: as it is, and truncating to ``max_seq_len`` (the way
    sentence-transformers' ``truncation="longest_first"`` does, special tokens kept)."""

    def __init__(
        self, backend: tokenizers.Tokenizer, max_seq_len: int, do_lower_case: bool = False
    ) -> None:
        """``do_lower_case``: sentence_bert_config.json's; a Lowercase normalizer goes first."""
        backend = tokenizers.Tokenizer.from_str(backend.to_str())  # a copy: set up as below
        backend.no_padding()
        backend.no_truncation()
        if do_lower_case:
            first = [normalizers.Lowercase()]
            rest = [backend.normalizer] if backend.normalizer is not None else []
            backend.normalizer = normalizers.Sequence(first + rest)
        self._whole = backend
        self._truncating = tokenizers.Tokenizer.from_str(backend.to_str())
        self._truncating.enable_truncation(max_seq_len, strategy="longest_first")
        self.max_seq_len = max_seq_len

    @classmethod
    def from_dir(cls, path: Path, max_seq_len: int, do_lower_case: bool = False) -> EmbedTokenizer:
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in model directory {path}")
        return cls(tokenizers.Tokenizer.from_file(str(file)), max_seq_len, do_lower_case)

    @property
    def vocab_size(self) -> int:
        return self._whole.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: Sequence[str], truncate: bool = False) -> list[list[int]]:
        """Each text's ids, special tokens included; an over-long text is cut to
        ``max_seq_len`` with ``truncate``, else raises ``InputTooLongError``."""
        # encode_batch releases the GIL (as engine/tokenizer.py's encode)
        backend = self._truncating if truncate else self._whole
        ids = [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=True)]
        for i, one in enumerate(ids):
            if len(one) > self.max_seq_len:
                raise InputTooLongError(i, len(one), self.max_seq_len)
        return ids
