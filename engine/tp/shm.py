"""Collectives between the ranks of one host through shared memory: what a CPU group runs its
per-layer all-reduces, its commands and its logits over instead of gloo's sockets.

gloo took 1.1-1.5 ms an all-reduce of 8 KB between two pinned processes on this machine's two
cores (1,000 calls, 2026-11-29): a tiny model's decode step went from 0.9 ms alone to 10 ms at
TP 2, and every layer of a real one pays it twice. Here a call costs two copies and a wait on a
counter.

    one mapping, in /dev/shm (removed once every rank has it open):
    [ counter of rank 0 | ... of rank N-1 ]  one per cache line, the sequence number of the
                                             last call the rank wrote (and so finished the one
                                             before)
    [ pid of rank 0 | ... ]                  a rank waiting long checks that the others live
    [ parity 0: slot of rank 0 | ... | slot of rank N-1 ]
    [ parity 1: slot of rank 0 | ... | slot of rank N-1 ]

Call s uses the slots of parity s % 2. A rank writes its slot for call s only once every counter
has reached s - 1: each rank has then finished call s - 2, the last to read those slots. It then
sets its counter to s; an all-reduce waits for every counter to reach s and sums the slots in
rank order (the same sum, bit for bit, on every rank). A call longer than a slot goes in parts.
The stores are plain: x86's ordering (stores seen in program order) is what makes a counter
safe to read before the data; elsewhere the group keeps gloo.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

_LINE = 64  # bytes: one counter per cache line
_PIDS = 2048  # where the ranks' pids start
_HEADER = 4096
_LIVENESS_S = 0.1  # how often a long wait checks that every rank's process lives
SLOT_BYTES = 4 << 20
_SPIN = 2000  # busy polls before a wait starts yielding the core


def usable() -> bool:
    """Whether this host's memory ordering lets the counters work as plain stores."""
    return platform.machine() in ("x86_64", "AMD64") and Path("/dev/shm").is_dir()


def _running(pid: int) -> bool:
    """Whether process ``pid`` lives: a zombie (rank 0's own child, killed and not yet reaped)
    does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # unreadable here: assume it lives, the timeout still bounds the wait
    return state not in (b"Z", b"X")


class ShmCollectives:
    """Rank ``rank`` of ``size`` on one mapping; ``create`` on rank 0, then ``attach`` on the
    others by its name, then ``unlink`` once all have attached."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float, create: bool) -> None:
        self.path, self.rank, self.size, self.timeout_s = path, rank, size, timeout_s
        total = _HEADER + 2 * size * SLOT_BYTES
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, total)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        buf = memoryview(self._map)
        self._counters = np.ndarray((size,), np.int64, buf, 0, (_LINE,))
        self._pids = np.ndarray((size,), np.int64, buf, _PIDS)
        self._pids[rank] = os.getpid()
        self._bytes = torch.frombuffer(buf[_HEADER:], dtype=torch.uint8)
        self._seq = 0
        # spinning only pays when every rank has a core: more ranks than cores, and a spinning
        # rank takes the core the one it waits for needs
        self._spin = _SPIN if size <= len(os.sched_getaffinity(0)) else 0

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/pdserve-tp-{os.getpid()}-{secrets.token_hex(6)}"

    def unlink(self) -> None:
        """Remove the name (the mapping lives on in every rank that has it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> None:
        """``t`` (contiguous, on the host) becomes the sum over ranks, in rank order."""
        flat = t.view(-1)
        for part in self._parts(flat):
            slots = self._begin(part)
            self._publish()
            self._wait_all(self._seq)
            torch.add(slots[0], slots[1], out=part)
            for slot in slots[2:]:
                part += slot

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` on rank 0 (copies, in rank order); None elsewhere."""
        flat = t.contiguous().view(-1)
        outs = [torch.empty_like(flat) for _ in range(self.size)] if self.rank == 0 else None
        at = 0
        for part in self._parts(flat):
            slots = self._begin(part)
            self._publish()
            if outs is not None:
                self._wait_all(self._seq)
                for out, slot in zip(outs, slots, strict=True):
                    out[at : at + part.numel()].copy_(slot)
            at += part.numel()
        return None if outs is None else [o.view(t.shape) for o in outs]

    def gather_into(
        self,
        nbytes: int,
        write: Callable[[torch.Tensor], None],
        read: Callable[[list[torch.Tensor]], None] | None,
    ) -> None:
        """A gather whose payload each rank writes into its slot itself (``write(slot)``, a
        uint8 view of ``nbytes``) and rank 0 reads where it lies (``read(slots)``, rank
        order): no copy in or out of a staging tensor. ``nbytes`` fits one slot."""
        if nbytes > SLOT_BYTES:
            raise ValueError(f"{nbytes} bytes do not fit a {SLOT_BYTES}-byte slot")
        self._seq += 1
        self._wait_all(self._seq - 1)
        write(self._raw(self.rank, nbytes))
        self._publish()
        if self.rank == 0 and read is not None:
            self._wait_all(self._seq)
            read([self._raw(r, nbytes) for r in range(self.size)])

    def _raw(self, rank: int, nbytes: int) -> torch.Tensor:
        start = ((self._seq & 1) * self.size + rank) * SLOT_BYTES
        return self._bytes[start : start + nbytes]

    def broadcast(self, t: torch.Tensor, idle: bool = False) -> None:
        """Rank 0's ``t`` into every rank's ``t``. ``idle``: the wait may be long (a rank
        awaiting its next command), so it spins less before yielding the core."""
        flat = t.view(-1)
        for part in self._parts(flat):
            self._seq += 1
            self._wait_all(self._seq - 1, idle)
            slot = self._slot(0, part)
            if self.rank == 0:
                slot.copy_(part)
            else:
                self._wait_rank(0, self._seq, idle)
                part.copy_(slot)
            self._publish()

    # ---- the protocol -----------------------------------------------------------------------
    def _parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        per = SLOT_BYTES // flat.element_size()
        return (
            [flat[i : i + per] for i in range(0, max(flat.numel(), 1), per)] if flat.numel() else []
        )

    def _slot(self, rank: int, like: torch.Tensor) -> torch.Tensor:
        parity = self._seq & 1
        start = (parity * self.size + rank) * SLOT_BYTES
        raw = self._bytes[start : start + like.numel() * like.element_size()]
        return raw.view(like.dtype)

    def _begin(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Next call: wait until every rank finished the one before last, write ``part`` into
        this rank's slot; every rank's slot of this call."""
        self._seq += 1
        self._wait_all(self._seq - 1)
        self._slot(self.rank, part).copy_(part)
        return [self._slot(r, part) for r in range(self.size)]

    def _publish(self) -> None:
        self._counters[self.rank] = self._seq

    def _wait_all(self, seq: int, idle: bool = False) -> None:
        counters = self._counters
        if counters.min() >= seq:
            return
        self._wait(lambda: bool(counters.min() >= seq), idle)

    def _wait_rank(self, rank: int, seq: int, idle: bool) -> None:
        counters = self._counters
        if counters[rank] >= seq:
            return
        self._wait(lambda: bool(counters[rank] >= seq), idle)

    def _wait(self, ready: Callable[[], bool], idle: bool) -> None:
        """Until ``ready()``: spinning a while (not when ``idle``), then yielding the core and
        backing off to 1 ms sleeps; ``GroupFailed`` when a rank's process is gone or the
        timeout passes."""
        for _ in range(self._spin // 2 if idle else self._spin):
            if ready():
                return
        now = time.monotonic()
        deadline, look = now + self.timeout_s, now + _LIVENESS_S
        pause = 0.0
        while not ready():
            now = time.monotonic()
            if now > look:
                self._check_ranks_live()
                look = now + _LIVENESS_S
            if now > deadline:
                self._fail(f"a rank did not come to a collective within {self.timeout_s:g} s")
            time.sleep(pause)  # 0 first: yield the core; then back off to 1 ms
            pause = min(1e-3, pause * 2 or 1e-5)

    def _check_ranks_live(self) -> None:
        for rank, pid in enumerate(self._pids.tolist()):
            if rank != self.rank and pid > 0 and not _running(pid):
                self._fail(f"rank {rank} (pid {pid}) is gone")

    def _fail(self, why: str) -> None:
        from pdserve.engine.tp.group import GroupFailed

        raise GroupFailed(f"tensor-parallel rank {self.rank}/{self.size}: {why}")
