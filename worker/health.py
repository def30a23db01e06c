"""A worker's answers to ``/livez`` and ``/readyz`` (``runtime/health_http.py``)::

    starting ──(engine loaded, loop running)──▶ serving ──(SIGTERM)──▶ draining ──▶ exit
    livez:    ok                       ok unless the loop stalled    (as serving)
    readyz:   503 starting             ok when the coordinator       503 draining
                                       admitted us, not stalled

Live while starting: loading a model takes minutes on a GPU, and a restart would only begin
it again. Stalled is ``runtime/liveness.py``'s notion (the step loop has not come round within
``--stall-timeout``), when heartbeats stop and the coordinator declares the worker dead.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Protocol

import zmq

from pdserve.runtime.coordinator_link import CoordinatorLink
from pdserve.runtime.health_http import HealthServer, start_health
from pdserve.runtime.liveness import Liveness


class Draining(Protocol):
    """What the probes read of a worker: whether it drains."""

    @property
    def draining(self) -> bool: ...


@dataclass(frozen=True)
class Serving:
    """What a serving worker's probes read (each written whole by the thread that owns it)."""

    worker: Draining  # a Worker, or an embed worker (prefill/embed.py)
    liveness: Liveness
    link: CoordinatorLink | None  # None: readiness does not ask the coordinator


class WorkerHealth:
    """The probes of one worker process, and with ``--health-port`` their server and the
    connection that tells whether the coordinator admits this worker (``start``, ``serving``
    once the loop is about to run, ``close`` before the ZMQ context is terminated)."""

    def __init__(self, server: HealthServer | None = None) -> None:
        self._serving: Serving | None = None
        self.server = server
        self._link: CoordinatorLink | None = None

    @classmethod
    def start(cls, args: argparse.Namespace) -> WorkerHealth:
        """Probes answering from now on (before the engine loads) if ``--health-port``."""
        health = cls()
        health.server = start_health(args, health.livez, health.readyz)
        return health

    def serving(
        self, worker: Draining, liveness: Liveness, ctx: zmq.SyncContext, coordinator: str
    ) -> None:
        if self.server is not None:  # nobody asks otherwise: no connection to watch
            self._link = CoordinatorLink(ctx, coordinator).start()
        self._serving = Serving(worker, liveness, self._link)

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        if self.server is not None:
            self.server.close()

    def livez(self) -> str | None:
        state = self._serving
        if state is not None and state.liveness.stalled:
            return (
                f"stalled: the step loop has not come round for {state.liveness.stall_timeout_s:g}s"
            )
        return None

    def readyz(self) -> str | None:
        state = self._serving
        if state is None:
            return "starting: the engine is loading"
        if state.worker.draining:
            return "draining: finishing the work in flight, taking no more"
        if state.liveness.stalled:
            return "stalled: the step loop does not come round"
        return None if state.link is None else state.link.problem
