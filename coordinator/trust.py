"""What the coordinator believes of a worker: its id is bound to the key that registered it,
and the numbers it reports must fit what it registered.

A worker's figures steer placement (the most free blocks, the fewest queued tokens win), so an
impossible one (a billion blocks, a negative queue) would draw every request. Such a message is
refused and logged, never clipped into something plausible.
"""

from __future__ import annotations

import logging
import time

from pdserve.protocol import messages as m
from pdserve.protocol.prefix import HASH_BITS, MAX_KV_EVENT_HASHES

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
MAX_KV_BYTES = 64 << 40  # one worker's KV cache: more than any node holds (64 TiB)
MAX_LAYOUT = {"block_size": 4096, "num_layers": 1024, "num_kv_heads": 1024, "head_dim": 4096}
MAX_MODEL_LEN = 1 << 24
MAX_REQUESTS = 1 << 20  # running or waiting on one worker
MAX_QUEUED_TOKENS = 1 << 40


def register_problem(info: m.Register) -> str | None:
    """Why a ``Register`` cannot be true, or None."""
    layout = info.layout
    for name, limit in MAX_LAYOUT.items():
        value = getattr(layout, name)
        if not 1 <= value <= limit:
            return f"layout {name}={value} is outside [1, {limit}]"
    size = DTYPE_BYTES.get(layout.dtype)
    if size is None:
        return f"unknown KV dtype {layout.dtype!r}"
    block_bytes = 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * size
    block_bytes *= layout.num_layers
    if not 1 <= info.num_blocks <= MAX_KV_BYTES // block_bytes:
        return (
            f"num_blocks={info.num_blocks} is outside [1, {MAX_KV_BYTES // block_bytes}] "
            f"({block_bytes} bytes a block, at most {MAX_KV_BYTES >> 40} TiB of KV a worker)"
        )
    if not 0 <= info.max_model_len <= MAX_MODEL_LEN:
        return f"max_model_len={info.max_model_len} is outside [0, {MAX_MODEL_LEN}]"
    return None


def heartbeat_problem(hb: m.Heartbeat | m.Reserved, num_blocks: int) -> str | None:
    """Why a ``Heartbeat`` (or the figures in a ``Reserved``) cannot be true of a worker that
    registered ``num_blocks``, or None."""
    if isinstance(hb, m.Reserved):
        if hb.free_blocks > num_blocks or any(not 0 <= b < num_blocks for b in hb.block_ids):
            return f"free_blocks={hb.free_blocks} or block ids outside [0, {num_blocks})"
        return None
    if hb.total_blocks != num_blocks:
        return f"total_blocks={hb.total_blocks}, registered {num_blocks}"
    if hb.free_blocks < 0 or hb.used_blocks < 0 or hb.free_blocks + hb.used_blocks > num_blocks:
        return f"free_blocks={hb.free_blocks} used_blocks={hb.used_blocks} of {num_blocks}"
    for name in ("running", "waiting"):
        if not 0 <= getattr(hb, name) <= MAX_REQUESTS:
            return f"{name}={getattr(hb, name)} is outside [0, {MAX_REQUESTS}]"
    if not 0 <= hb.queued_prompt_tokens <= MAX_QUEUED_TOKENS:
        return f"queued_prompt_tokens={hb.queued_prompt_tokens} is outside [0, {MAX_QUEUED_TOKENS}]"
    return counters_problem(hb.counters)


def counters_problem(c: m.WorkerCounters) -> str | None:
    """Totals that cannot be a worker's: negative, not finite, or a histogram of the wrong
    shape (they are only shown in ``/metrics``, but never as garbage)."""
    totals = (c.prefix_hit_tokens, c.prefill_tokens, c.kv_blocks_sent, c.kv_bytes_sent)
    if any(not 0 <= v < 1 << 63 for v in (*totals, *c.transfer_seconds_counts)):
        return "a counter outside [0, 2**63)"
    if not 0.0 <= c.transfer_seconds_sum < float(1 << 63):  # NaN fails too
        return f"transfer_seconds_sum={c.transfer_seconds_sum}"
    if len(c.transfer_seconds_counts) not in (0, len(m.TRANSFER_SECONDS_BUCKETS) + 1):
        return f"{len(c.transfer_seconds_counts)} transfer-time buckets"
    return None


def kv_events_problem(ev: m.KVEvents, num_blocks: int) -> str | None:
    """Why a ``KVEvents`` cannot be true of a worker that registered ``num_blocks``, or None.
    (What it adds up to over many messages is bounded in ``coordinator.kv_index``.)"""
    if len(ev.stored) + len(ev.evicted) > MAX_KV_EVENT_HASHES:
        return f"{len(ev.stored) + len(ev.evicted)} hashes, at most {MAX_KV_EVENT_HASHES}"
    if not 1 <= len(ev.epoch) <= 64 or not 0 <= ev.seq < 1 << 63:
        return f"epoch {ev.epoch[:64]!r} or seq={ev.seq}"
    if any(not 0 <= h < 1 << HASH_BITS for h in (*ev.stored, *ev.evicted)):
        return f"a block hash outside [0, 2**{HASH_BITS})"
    max_parts = max(1, -(-num_blocks // MAX_KV_EVENT_HASHES))
    if ev.snapshot and (ev.evicted or not 0 <= ev.part < ev.parts <= max_parts):
        return f"snapshot part {ev.part} of {ev.parts} (at most {max_parts}) with evictions"
    if not ev.snapshot and (ev.part, ev.parts) != (0, 1):
        return f"part {ev.part} of {ev.parts} outside a snapshot"
    return None


class RateLimitedLog:
    """One line per key every ``interval_s``: a peer repeating a refused message each second
    must not flood the log."""

    def __init__(self, interval_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def error(self, key: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(key, float("-inf")) < self.interval_s:
            return
        if len(self._last) > 4096:
            self._last.clear()
        self._last[key] = now
        logger.error(fmt, *args)
