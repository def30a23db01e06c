"""Prefix-cache block hashes: the engine caches full KV blocks under them, and the coordinator
routes by them (``coordinator.kv_index``), so both compute them here, the same way.

A block's hash chains its parent's, ``h_i = H(h_{i-1}, tokens of block i)``: equal hashes mean
equal prefixes, and the i-th hash of a prompt names its whole first ``(i + 1) * block_size``
tokens. The last prompt token is never served from the cache (its logits must be computed),
so a prompt of ``n`` tokens can hit at most ``(n - 1) // block_size`` blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_BITS = 64  # hashes are unsigned: 0 <= h < 2**64
# hashes in one ``KVEvents`` message (about 9 bytes each in msgpack: 37 KB at most)
MAX_KV_EVENT_HASHES = 4096


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    """Stable across processes (unlike ``hash``), so workers can compare prefixes."""
    h = hashlib.blake2b(digest_size=HASH_BITS // 8)
    h.update((parent if parent is not None else 0).to_bytes(8, "little", signed=False))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, known: list[int]) -> list[int]:
    """Extend ``known`` (hashes of the leading full blocks) to every full block of the tokens."""
    for i in range(len(known), len(token_ids) // block_size):
        parent = known[-1] if known else None
        known.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return known


def cacheable_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of the prompt's blocks a prefix cache could serve (all but the last token's)."""
    limit = max(0, len(prompt_token_ids) - 1) // block_size
    return block_hashes(prompt_token_ids[: limit * block_size], block_size, [])
