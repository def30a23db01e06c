"""Cores lent between the workers of one host: a small board they share (``pdserve serve``).

    board file, in serve's private run directory (one per launch): SLOTS x 64 bytes
    slot i (worker i of the launch):  byte 0  busy (1 while its engine has work)
                                      4..7    its own threads (uint32, 0: slot unused)
                                      8..11   its pid (uint32)

Each worker writes its own slot: its threads once, and before each step whether its engine has
work. Its quantized layers (the most of a step) then run on its own threads plus those of every
other worker that is idle now, at most the cores this process may run on. With one or two
streams and the prefill worker idle, a decode step gets both cores, as llama.cpp gives one
stream all its threads (a decode worker's steps of up to ``DECODE_LEND_ROWS`` rows: many
streams' steps keep their own threads). Asked before every kernel call, so a worker that
starts a step takes its cores back within one layer of the other's. The kernels' results do
not depend on their thread count (engine/quant/), so lending changes no token.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path

SLOTS = 64
SLOT_BYTES = 64
BOARD_BYTES = SLOTS * SLOT_BYTES
REFRESH_S = 1.0  # how often the list of other workers (their slots and threads) is reread
# A decode worker's steps of at most this many rows borrow: a few streams' steps gain most; with
# 32 streams borrowing lost 10% of make serve's tokens/s (a prompt arrives every few steps and
# takes its core back mid-step: bench/results/peers_serve.md). A prefill worker's steps always
# may (with 1 and 8 streams its prompts on both cores were most of the gain, measured).
DECODE_LEND_ROWS = 16


class CoreBoard:
    """This worker's slot on a board, and the threads it may run on now (``threads``)."""

    def __init__(
        self, path: Path, slot: int, own_threads: int, max_rows: int | None = None
    ) -> None:
        """``max_rows``: calls over more rows than this keep to ``own_threads`` (None: any
        call may borrow)."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"core board slot must be in [0, {SLOTS}), got {slot}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < BOARD_BYTES:
                os.ftruncate(fd, BOARD_BYTES)  # every worker asks for the same size: no race
            self._mm = mmap.mmap(fd, BOARD_BYTES)
        finally:
            os.close(fd)
        self.path, self.slot, self.own = path, slot, max(1, own_threads)
        self.max_rows = max_rows
        self._at = slot * SLOT_BYTES
        self.cores = len(os.sched_getaffinity(0))
        struct.pack_into("<BxxxII", self._mm, self._at, 1, self.own, os.getpid())
        self._others: list[tuple[int, int]] = []  # (byte offset of a busy flag, its threads)
        self._refreshed = -REFRESH_S

    def set_busy(self, busy: bool) -> None:
        self._mm[self._at] = 1 if busy else 0

    def threads(self, rows: int = 1) -> int:
        """For a call over ``rows`` rows: own threads, plus (within ``max_rows``) those of
        every idle worker on the board, as far as the cores the busy ones leave allow."""
        if self.max_rows is not None and rows > self.max_rows:
            return self.own
        now = time.monotonic()
        if now - self._refreshed >= REFRESH_S:
            self._refresh(now)
        mm, idle, busy = self._mm, 0, 0
        for at, threads in self._others:
            if mm[at]:
                busy += threads
            else:
                idle += threads
        # never more threads than the cores the busy workers leave: with more workers than
        # cores (autoscaling), an idle worker's share is not a free core
        return max(self.own, min(self.own + idle, self.cores - busy))

    def _refresh(self, now: float) -> None:
        others = []
        for i in range(SLOTS):
            if i != self.slot:
                _, threads, _ = struct.unpack_from("<BxxxII", self._mm, i * SLOT_BYTES)
                if threads:
                    others.append((i * SLOT_BYTES, threads))
        self._others, self._refreshed = others, now

    def close(self) -> None:
        """Leave the board: the slot says busy, so nobody borrows a core it no longer frees."""
        self.set_busy(True)
        self._mm.close()
