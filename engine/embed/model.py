"""``EmbeddingModel``: text or token ids → one float32 vector per input, on CPU.

    texts ──EmbedTokenizer──▶ ids ──encoder──▶ [T, E] ──pool──▶ [N, dim] ──(L2)──▶ embeddings

Two kinds of encoder behind one API, told apart by config.json: a BERT encoder
(``model_type`` bert: all-MiniLM-L6-v2, bge-small) and the repository's decoder (Llama,
Mistral, Qwen2, Qwen3: Qwen3-Embedding), the latter only where sentence-transformers' files ask
for pooling. The network sees a packed batch; an input's vector does not depend on its batch.
Threads are the caller's: ``from_dir(threads=...)`` sets torch's only when given. Linear
layers run through oneDNN with packed weights where it works (engine/cpu_linear.py, as
``--cpu-linear auto``): all-MiniLM-L6-v2 on one thread embeds 1.9x as fast as through MKL.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from pdserve.engine.config import SUPPORTED_ARCHITECTURES
from pdserve.engine.cpu_linear import pack_linears, use_onednn
from pdserve.engine.embed.pooling import normalize, pool
from pdserve.engine.embed.sentence_config import (
    EmbeddingConfigError,
    SentenceConfig,
    read_sentence_config,
)
from pdserve.engine.embed.tokenize import EmbedTokenizer, InputTooLongError

LINEARS = ("auto", "onednn", "torch")  # as --cpu-linear
MAX_BATCH_TOKENS = 8192  # tokens per forward pass; a larger batch runs in several


class TokenEncoder(Protocol):
    """What ``EmbeddingModel`` needs of a network: last hidden states of a packed batch."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def max_positions(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def states(self, ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor: ...


class EmbeddingModel:
    """An encoder, a tokenizer and a ``SentenceConfig`` (pooling, normalisation, length)."""

    def __init__(
        self,
        name: str,
        kind: str,
        encoder: TokenEncoder,
        sentence: SentenceConfig,
        tokenizer: EmbedTokenizer,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        linear: str = "torch",
    ) -> None:
        """``linear``: how its linear layers run, ``onednn`` (packed) or ``torch``."""
        self.name, self.kind = name, kind
        self.encoder, self.sentence, self.tokenizer = encoder, sentence, tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.linear = linear

    @classmethod
    def from_dir(
        cls,
        path: str | Path,
        threads: int | None = None,
        name: str | None = None,
        linear: str = "auto",
    ) -> EmbeddingModel:
        """The model in ``path`` (a Hugging Face directory with sentence-transformers' files);
        ``threads``: set torch's intra-op threads to this (left alone when None); ``linear``:
        ``auto`` (oneDNN where it works), ``onednn`` (an error where not) or ``torch``."""
        path = Path(path)
        if linear not in LINEARS:
            raise ValueError(f"linear must be one of {', '.join(LINEARS)}, got {linear!r}")
        if threads is not None:
            torch.set_num_threads(threads)
        kind = model_kind(path)
        encoder: TokenEncoder
        if kind == "bert":
            from pdserve.engine.embed.bert import load_bert

            bert = encoder = load_bert(path)
            sentence = read_sentence_config(path, encoder.max_positions, decoder=False)
            linear = _pack(bert, linear)
        else:
            from pdserve.engine.embed.decoder import decoder_config, load_decoder

            limit = decoder_config(path).max_model_len
            sentence = read_sentence_config(path, limit, decoder=True)
            decoder = encoder = load_decoder(path, sentence.max_seq_len)
            linear = _pack(decoder.model, linear)
        tokenizer = EmbedTokenizer.from_dir(path, sentence.max_seq_len, sentence.do_lower_case)
        return cls(name or path.name, kind, encoder, sentence, tokenizer, linear=linear)

    @property
    def dim(self) -> int:
        """Length of an embedding: the hidden size once per pooling mode."""
        return self.encoder.hidden_size * len(self.sentence.pooling)

    @property
    def max_seq_len(self) -> int:
        """Most tokens an input may have, special tokens included."""
        return self.sentence.max_seq_len

    def tokenize(self, texts: Sequence[str], truncate: bool = False) -> list[list[int]]:
        """Ids with the model's special tokens; over-long: cut with ``truncate``, else
        ``InputTooLongError`` (a ValueError)."""
        return self.tokenizer.encode(texts, truncate)

    def embed_texts(self, texts: Sequence[str], truncate: bool = False) -> torch.Tensor:
        return self.embed(self.tokenize(texts, truncate))

    def embed(self, token_id_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """[N, dim] float32, one row per input (ids as ``tokenize`` makes them). An empty or
        over-long input, or an id outside the vocabulary, is a ValueError naming the input."""
        self._check(token_id_lists)
        out = [torch.empty(0, self.dim)]
        for group in _groups([len(ids) for ids in token_id_lists], self.max_batch_tokens):
            batch = [token_id_lists[i] for i in group]
            ids = torch.tensor([t for one in batch for t in one], dtype=torch.long)
            lengths = [len(one) for one in batch]
            vectors = pool(self.encoder.states(ids, lengths), lengths, self.sentence.pooling)
            out.append(normalize(vectors) if self.sentence.normalize else vectors)
        return torch.cat(out).float()

    def _check(self, token_id_lists: Sequence[Sequence[int]]) -> None:
        vocab = self.encoder.vocab_size
        for i, ids in enumerate(token_id_lists):
            if not ids:
                raise ValueError(f"input {i} has no tokens")
            if len(ids) > self.max_seq_len:
                raise InputTooLongError(i, len(ids), self.max_seq_len)
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"input {i} has a token id outside the vocabulary (0..{vocab})")


def model_kind(path: Path) -> str:
    """``bert`` or ``decoder``, from config.json's ``model_type`` and ``architectures``."""
    file = path / "config.json"
    if not file.is_file():
        raise EmbeddingConfigError(f"model directory {path} has no config.json")
    cfg = json.loads(file.read_text())
    archs = [str(a) for a in cfg.get("architectures") or []]
    if cfg.get("model_type") == "bert" or any(a.startswith("Bert") for a in archs):
        return "bert"
    families = set(SUPPORTED_ARCHITECTURES.values())
    heads = [a.removesuffix("Model") + "ForCausalLM" for a in archs]
    if cfg.get("model_type") in families or any(a in SUPPORTED_ARCHITECTURES for a in heads):
        return "decoder"
    raise EmbeddingConfigError(
        f"{file}: {archs or cfg.get('model_type')!r} is neither a BERT encoder nor a decoder "
        f"this engine runs ({', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
    )


def _pack(module: nn.Module, choice: str) -> str:
    """``module``'s linear layers packed for oneDNN unless ``choice`` is torch or oneDNN is
    unusable here (an error if ``choice`` is onednn); what they run through."""
    if not use_onednn(choice, torch.float32, "linear", "embedding model's linear layers"):
        return "torch"
    pack_linears(module)
    return "onednn"


def _groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive inputs in groups of at most ``budget`` tokens (an input alone may exceed)."""
    groups: list[list[int]] = []
    used = budget
    for i, n in enumerate(lengths):
        if used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups
