"""The background thread each backend runs, as a part it holds: ``LoopThread`` (a receiver's:
its loop waits on its own socket or agent) and ``SenderThread`` (a ``LoopThread`` with the
queue of jobs the caller fills and the socketpair that wakes it).

A backend builds its parts, then calls ``start(self._run)`` last; ``_run`` is the backend's
loop, which runs until ``stop`` (``close``)::

    caller thread                            sender thread (the backend's ``_run``)
    send: table.add(rid), put(job) ─wake─▶   wait(timeout) ─ take() ─ ... table.advance(rid)
    close: stop() ─────────────wake─▶        running is False: the loop ends; joined

    receiver thread: while running (or idle(timeout)): its socket or agent, table.expire()
"""

from __future__ import annotations

import queue
import select
import socket
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

JobT = TypeVar("JobT")


class LoopThread:
    """A thread running a backend's loop until ``stop``; the loop checks ``running`` (or sleeps
    in ``idle``) between its polls, so ``stop`` ends it within one of them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, run: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """False once ``stop`` was asked."""
        return not self._stop.is_set()

    def idle(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``, cut short by ``stop``; whether to go on."""
        return not self._stop.wait(timeout_s)

    def stop(self, wake: Callable[[], None] = lambda: None) -> bool:
        """End (``wake``: rouse a loop asleep elsewhere) and join the thread; False if that was
        done already (``close`` is idempotent)."""
        if self._stop.is_set():
            return False
        self._stop.set()
        wake()
        if self._thread is not None:
            self._thread.join()
        return True


class SenderThread(Generic[JobT]):
    """A sender's loop thread, its job queue and the socketpair that wakes it when a job (or
    ``stop``) comes; the jobs are the backend's."""

    def __init__(self, name: str) -> None:
        self._loop = LoopThread(name)
        self._jobs: queue.SimpleQueue[JobT] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)

    def start(self, run: Callable[[], None]) -> None:
        self._loop.start(run)

    @property
    def running(self) -> bool:
        """False once ``stop`` was asked (a closed sender takes no more jobs)."""
        return self._loop.running

    def put(self, job: JobT) -> None:
        self._jobs.put(job)
        self._wake()

    def _wake(self) -> None:
        self._wake_w.send(b"\0")

    def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, cut short by a ``put`` or ``stop``."""
        select.select([self._wake_r], [], [], timeout_s)
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def take(self) -> list[JobT]:
        """Every job queued since the last ``take``, in order."""
        jobs = []
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                return jobs

    def stop(self) -> bool:
        """End and join the thread; False if that was done already (``close`` is idempotent)."""
        if not self._loop.stop(wake=self._wake):
            return False
        self._wake_r.close()
        self._wake_w.close()
        return True
