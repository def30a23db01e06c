"""Prompt text of a chosen length in tokens, two ways:

- ``TokenPrompts``: with the model's ``tokenizer.json`` (loaded with the ``tokenizers`` library,
  nothing of the serving code): random ids from the vocabulary, decoded, re-encoded and
  trimmed until the text is exactly ``n`` tokens (vLLM's random dataset does the same).
- ``WordPrompts``: without a tokenizer: random common words, as many as ``n`` tokens take at the
  target's measured tokens per word (``calibrate``: two probe prompts, the slope of the server's
  ``usage.prompt_tokens``, so a chat template's fixed overhead cancels out).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import tokenizers

_COMMON_WORDS = (
    "the of and to in is that it was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like "
    "so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell "
    "does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father head"
)
WORDS = _COMMON_WORDS.split()

PROBE_WORDS = (32, 288)


class PromptMaker(Protocol):
    def text(self, num_tokens: int, rng: np.random.Generator) -> str: ...

    def count(self, text: str) -> int: ...


def load_tokenizer(path: str | Path) -> tokenizers.Tokenizer:
    """``tokenizer.json`` in ``path`` (a model directory) or ``path`` itself."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return tokenizers.Tokenizer.from_file(str(file))


class TokenPrompts:
    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        special = set(tokenizer.get_added_tokens_decoder())
        # tokens that are text on their own (not part of a UTF-8 sequence, not special)
        self.ids = np.array(
            [
                i
                for i in range(tokenizer.get_vocab_size())
                if i not in special and "\ufffd" not in tokenizer.decode([i])
            ]
        )

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        ids = rng.choice(self.ids, num_tokens).tolist()
        text = self.tokenizer.decode(ids)
        for _ in range(8):  # re-encoding merges or splits a few tokens; trim or top up
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) == num_tokens:
                break
            if len(ids) > num_tokens:
                ids = ids[:num_tokens]
            else:
                ids += rng.choice(self.ids, num_tokens - len(ids)).tolist()
            text = self.tokenizer.decode(ids)
        return text


class WordPrompts:
    def __init__(self, tokens_per_word: float) -> None:
        if tokens_per_word <= 0:
            raise ValueError(f"tokens per word must be positive, got {tokens_per_word}")
        self.tokens_per_word = tokens_per_word

    def count(self, text: str) -> int:
        return round(len(text.split()) * self.tokens_per_word)

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        num_words = max(1, round(num_tokens / self.tokens_per_word))
        return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), num_words))


async def calibrate(prompt_tokens: Callable[[str], Awaitable[int | None]], seed: int = 0) -> float:
    """Tokens per word on the target: the slope between two probe prompts' ``prompt_tokens``.

    ``prompt_tokens(text)`` asks the server; ``ValueError`` if it does not report usage."""
    rng = np.random.default_rng(seed)
    probe = WordPrompts(1.0)
    counts = []
    for words in PROBE_WORDS:
        tokens = await prompt_tokens(probe.text(words, rng))
        if tokens is None:
            raise ValueError("the target reports no usage.prompt_tokens; pass --tokenizer DIR")
        counts.append(tokens)
    slope = (counts[1] - counts[0]) / (PROBE_WORDS[1] - PROBE_WORDS[0])
    if slope <= 0:
        raise ValueError(f"calibration failed: prompt_tokens {counts} for {PROBE_WORDS} words")
    return slope
