"""Logprobs in OpenAI's two formats, with each token's exact bytes.

A byte-level BPE token can hold part of a UTF-8 character; its ``token`` string then shows
U+FFFD, but ``bytes`` carries the real bytes, so a client can rebuild the text from them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.messages import TokenLogprob

_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_LEVEL = _byte_level_decoder()


class TokenTexts:
    """id -> (display string, exact bytes), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, text.encode("utf-8")
        token = self._tokenizer.convert_ids_to_tokens([token_id])[0]
        if all(c in _BYTE_LEVEL for c in token):
            return text, bytes(_BYTE_LEVEL[c] for c in token)
        match = _HEX_BYTE.fullmatch(token)
        if match:
            return text, bytes.fromhex(match.group(1))
        return text, text.encode("utf-8")


@dataclass(frozen=True)
class LogprobEntry:
    """One output position, resolved to strings."""

    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[str, bytes, float], ...]
    text_offset: int  # where this token's text starts in the choice's text


def resolve(
    texts: TokenTexts, token_id: int, logprobs: TokenLogprob, text_offset: int
) -> LogprobEntry:
    token, raw = texts.get(token_id)
    top = tuple((*texts.get(i), lp) for i, lp in logprobs.top)
    return LogprobEntry(token, raw, logprobs.logprob, top, text_offset)


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token_bytes),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in e.top
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """The legacy format; ``top_logprobs`` maps token -> logprob, the sampled token included
    (as vLLM does), so ``logprobs=0`` still names the sampled token."""
    tops = []
    for e in entries:
        top = {t: lp for t, _, lp in e.top}
        top.setdefault(e.token, e.logprob)
        tops.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": [e.text_offset for e in entries],
    }
