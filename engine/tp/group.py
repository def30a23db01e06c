"""A tensor-parallel group's processes and their collectives (``torch.distributed``).

gloo on CPU, NCCL on CUDA (one GPU a rank). Rank 0 leads: it is the worker the cluster sees
and drives the others with commands, one broadcast header each (and a payload where the
command has one); the others loop on ``next_command`` until STOP::

    rank 0 (the worker)                          rank r > 0 (engine/tp/follower.py)
    command(STEP, inputs)  ──broadcast──▶        next_command() -> STEP: run the step
    model: all_reduce after o_proj, down_proj ◀─▶ the same, in the same order
    gather_rows(logits) -> the whole vocabulary  ◀── its slice of the vocabulary

Every collective has the group's timeout: a rank that hangs fails the others' calls within it,
and a rank that dies fails them at once (its sockets close). A failure is ``GroupFailed``, a
``SystemExit``: the process ends, and its worker with it, as one would alone.

The rendezvous (a file in a private directory for a group started on one host, else a TCP
store) and the collectives carry no authentication: a TCP rendezvous belongs on a network only
the group's hosts reach (README), and nothing received here but tensors is acted on.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from pdserve.engine.config import ConfigError
from pdserve.engine.tp import shm

# torch's stubs leave the c10d classes this module drives directly (stores, process groups,
# their options) unexported: reached through an Any
_c10d: Any = dist

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
_HEADER = 2  # int64s: command, payload length


class Command(enum.IntEnum):
    STEP = 1  # payload: engine/tp/commands.py's step encoding
    COPY_BLOCKS = 2  # payload: source ids then destination ids
    GATHER_KV = 3  # payload: block ids; each rank's heads of them to rank 0
    SCATTER_KV = 4  # payload: block ids; rank 0 sends each rank its heads of them
    PING = 5  # nothing: keeps an idle group's ranks sure the leader lives
    STOP = 6


class GroupFailed(SystemExit):
    """A collective failed: a rank died, hung past the timeout, or the group disagrees."""


class TPGroup:
    """This process's place in a group of ``size`` ranks, and the group's collectives."""

    def __init__(
        self,
        rank: int,
        size: int,
        rendezvous: str,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        join_timeout_s: float = 300.0,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = timeout_s
        self.stop: Callable[[], None] = self.close  # rank 0: STOP the others too (launch.py)
        self.stopped = False
        self._lock = threading.Lock()  # one command (header and its collectives) at a time
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "gloo" and _on_one_host(rendezvous):  # gloo's own sockets: loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = _store(rendezvous, rank, size, join_timeout_s)
            # groups of their own, not torch's default one: one process may lead several
            # (tests, an in-process cluster). Commands and start-up checks go over gloo on
            # host memory even beside NCCL (vLLM's CPU group does the same).
            self._host = _c10d.ProcessGroupGloo(
                _c10d.PrefixStore("host/", store), rank, size, timeout
            )
            self._pg = self._host
            if backend == "nccl":
                options = _c10d.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self._pg = _c10d.ProcessGroupNCCL(
                    _c10d.PrefixStore("nccl/", store), rank, size, options
                )
            self._shm = None
            if backend == "gloo" and _on_one_host(rendezvous) and shm.usable():
                self._shm = self._attach_shm(store)
        except (RuntimeError, ValueError, OSError) as e:
            raise GroupFailed(f"tensor-parallel rank {rank}/{size}: rendezvous failed: {e}") from e
        self.backend = backend if self._shm is None else "gloo+shm"
        logger.info(
            "tensor-parallel rank %d of %d (%s) joined via %s", rank, size, self.backend, rendezvous
        )

    def _attach_shm(self, store: Any) -> shm.ShmCollectives:
        """The ranks' shared mapping (engine/tp/shm.py): rank 0 makes it and names it in the
        store, the others open it; its name is removed once all have."""
        if self.leads:
            path = shm.ShmCollectives.new_path()
            channel = shm.ShmCollectives(path, 0, self.size, self.timeout_s, create=True)
            store.set("shm", path)
        else:
            path = store.get("shm").decode()
            channel = shm.ShmCollectives(path, self.rank, self.size, self.timeout_s, create=False)
        self.all_gather_bytes(b"attached")  # every rank has it open
        if self.leads:
            channel.unlink()
        return channel

    @property
    def leads(self) -> bool:
        return self.rank == 0

    # ---- commands (rank 0 sends, the others receive) ---------------------------------------
    def command(self, cmd: Command, payload: torch.Tensor | None = None) -> None:
        """Rank 0: tell every rank to run ``cmd`` (the caller then runs its own part)."""
        length = 0 if payload is None else payload.numel()
        self._broadcast(torch.tensor([int(cmd), length], dtype=torch.long))
        if payload is not None:
            self._broadcast(payload.to(torch.long).contiguous())

    def next_command(self) -> tuple[Command, torch.Tensor]:
        """Ranks past 0: the next command and its payload (int64)."""
        header = torch.zeros(_HEADER, dtype=torch.long)
        self._broadcast(header, idle=True)
        payload = torch.zeros(int(header[1]), dtype=torch.long)
        if payload.numel():
            self._broadcast(payload)
        return Command(int(header[0])), payload

    @property
    def lock(self) -> threading.Lock:
        """Held by rank 0 around a command and its collectives (any thread may issue one)."""
        return self._lock

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> None:
        """``t`` becomes the sum of every rank's ``t`` (in place)."""
        if self._shm is not None and t.is_contiguous():
            self._shm.all_reduce(t)
            return
        self._wait(self._pg.allreduce([t]))

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape and dtype on each) on rank 0, in rank order; None
        elsewhere."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.leads else None
        opts = _c10d.GatherOptions()
        opts.rootRank = 0
        outs = [] if parts is None else [[_wire(p) for p in parts]]
        self._wait(self._pg.gather(outs, [_wire(t)], opts))
        return parts

    @property
    def shm(self) -> shm.ShmCollectives | None:
        """The ranks' shared memory, on a CPU group on one host (else None)."""
        return self._shm

    def scatter(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> None:
        """Rank 0's ``parts[r]`` into rank r's ``out`` (``parts`` None past rank 0)."""
        opts = _c10d.ScatterOptions()
        opts.rootRank = 0
        ins = [] if parts is None else [[_wire(p.contiguous()) for p in parts]]
        self._wait(self._pg.scatter([_wire(out)], ins, opts))

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` on every rank (start-up agreement: no pickle, only bytes)."""
        n = torch.tensor([len(data)], dtype=torch.long)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.size)]
        self._wait(self._host.allgather([sizes], [n]))
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(max(longest, 1), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.zeros_like(mine) for _ in range(self.size)]
        self._wait(self._host.allgather([parts], [mine]))
        return [bytes(p[: int(s)].tolist()) for p, s in zip(parts, sizes, strict=True)]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.long)
        opts = _c10d.AllreduceOptions()
        opts.reduceOp = _c10d.ReduceOp.MIN
        self._wait(self._host.allreduce([t], opts))
        return int(t)

    def _broadcast(self, t: torch.Tensor, idle: bool = False) -> None:
        """A host tensor from rank 0 (over the host group beside NCCL); ``idle``: a rank
        awaiting its next command."""
        if self._shm is not None:
            self._shm.broadcast(t, idle)
            return
        opts = _c10d.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self._host.broadcast([_wire(t)], opts))

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except (RuntimeError, ValueError) as e:  # gloo and NCCL errors, timeouts included
            raise GroupFailed(
                f"tensor-parallel rank {self.rank}/{self.size}: a collective failed "
                f"(a rank died or hung past {self.timeout_s:g} s): {str(e)[:300]}"
            ) from e

    def close(self) -> None:
        """Let go of the group's connections (its peers' next collective fails)."""
        for pg in {id(self._pg): self._pg, id(self._host): self._host}.values():
            shutdown = getattr(pg, "shutdown", None)
            if callable(shutdown):
                with contextlib.suppress(RuntimeError):
                    shutdown()


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` as gloo moves it: 2-byte floats travel as int16 (the bits, unchanged)."""
    if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    return t


def _store(rendezvous: str, rank: int, size: int, timeout_s: float) -> Any:
    """``file:///path`` (one host: a file in a private directory) or ``tcp://host:port``
    (rank 0 serves it there, the others dial it)."""
    parts = urlsplit(rendezvous)
    if parts.scheme == "file":
        path = Path(parts.path)
        if not path.parent.is_dir():
            raise ConfigError(f"rendezvous directory {path.parent} does not exist")
        return _c10d.FileStore(str(path), size)
    if parts.scheme == "tcp" and parts.hostname and parts.port:
        return _c10d.TCPStore(
            parts.hostname,
            parts.port,
            size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,  # the process groups' own rendezvous waits for them
        )
    raise ConfigError(f"rendezvous must be file:///path or tcp://host:port, got {rendezvous!r}")


def _on_one_host(rendezvous: str) -> bool:
    parts = urlsplit(rendezvous)
    return parts.scheme == "file" or parts.hostname in ("127.0.0.1", "localhost", "::1")
