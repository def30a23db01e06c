"""The plumbing every threaded sender shares: the caller queues jobs and wakes the sender
thread through a socketpair; injected faults are decided at queue time; ``close`` stops it."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from pdserve.kvtransfer.faults import FaultDice, FaultPlan


class FaultableJob(Protocol):
    fault: str | None
    not_before: float


class QueuedSender:
    def _start_thread(
        self,
        name: str,
        run: Callable[[], None],
        ctx: zmq.Context | None,
        fault: FaultPlan | None,
    ) -> None:
        self._dice = FaultDice(fault) if fault is not None else None
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def _enqueue(self, job: FaultableJob) -> None:
        """Hand a job to the sender thread, marking it with this transfer's fault, if any."""
        if self._dice is not None and self._dice.hit():
            job.fault = self._dice.plan.mode
            if job.fault == "delay":
                job.not_before = time.monotonic() + self._dice.plan.delay_s
        self._jobs.put(job)
        self._wake_w.send(b"\0")

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _take_jobs(self) -> list[Any]:
        jobs = []
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                return jobs

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake_w.send(b"\0")
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()
        if self._own_ctx:
            self._ctx.term()
