"""The coordinator: pairs each request's choices with a decode and a prefill worker.

Route of one choice (``(request_id, choice)``)::

    Generate ─▶ reserving ──Reserved(ids)──▶ prefilling ──TransferDone──▶ decoding ──Finished─▶ ·
       │ (colocated pool: PrefillJob        │ Reserved(error)  │ Finished (token 0 ended it):
       │  straight to one worker ─▶ local)  ▼ 503 to gateway   ▼ Abort the decode reservation
    Abort from the gateway, RequestError from a worker, or a worker's death: every worker the
    route touches gets an Abort; the gateway hears a RequestError (unless it asked).

``Coordinator`` has no sockets: ``handle`` takes a message, ``tick`` expires dead workers,
and everything it says goes through a ``CoordinatorOutbox``.
"""

from __future__ import annotations

import logging
from typing import Protocol

from coordinator.registry import WorkerRegistry
from coordinator.routes import Key, Route, RouteTable
from kvtransfer.base import LayoutMismatchError
from protocol import messages as m

logger = logging.getLogger(__name__)


class CoordinatorOutbox(Protocol):
    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None: ...

    def to_gateway(self, address: str, msg: m.Message) -> None: ...

    def forget_worker(self, worker_id: str) -> None: ...


class Coordinator:
    def __init__(self, outbox: CoordinatorOutbox, heartbeat_timeout_s: float = 5.0) -> None:
        self.outbox = outbox
        self.registry = WorkerRegistry(heartbeat_timeout_s)
        self.routes = RouteTable()

    # ---- messages ---------------------------------------------------------------------------
    def handle(self, msg: m.Message, now: float) -> None:
        handler = {
            m.Register: self._register,
            m.Heartbeat: lambda hb, t: self.registry.heartbeat(hb, t),
            m.GatewayHello: lambda h, _t: self.outbox.to_gateway(
                h.stream_address, self.registry.cluster_state()
            ),
            m.Generate: self._generate,
            m.Reserved: self._reserved,
            m.TransferDone: self._transfer_done,
            m.Finished: self._finished,
            m.Abort: self._abort,
            m.RequestError: self._worker_error,
        }.get(type(msg))
        if handler is None:
            logger.warning("coordinator ignores %s", type(msg).__name__)
            return
        handler(msg, now)

    def tick(self, now: float) -> None:
        for worker in self.registry.expire(now):
            self.outbox.forget_worker(worker.worker_id)
            self._reroute_from(worker.worker_id)

    def _reroute_from(self, worker_id: str) -> None:
        for key, route in list(self.routes.items()):
            if key in self.routes and worker_id in (route.decode, route.prefill):
                self._worker_lost(key, route, worker_id)

    def _worker_lost(self, key: Key, route: Route, worker_id: str) -> None:
        """Work the dead worker had not started goes elsewhere; started work fails (503)."""
        req = route.request
        if route.state == "reserving" and route.decode == worker_id:
            self.routes.pop(key)
            self._reserve(req, route.choice)
        elif route.state == "prefilling" and route.prefill == worker_id:
            # the decode reservation still stands: prefill again on another worker
            prefill = self.registry.pick_prefill(req.model, len(req.prompt_token_ids))
            if prefill is None or route.job is None:
                self._fail(key, 503, f"worker {worker_id} stopped responding")
                return
            logger.info("request %s#%d: prefill moves to %s", key[0], key[1], prefill.worker_id)
            route.prefill = prefill.worker_id
            self._send(prefill.worker_id, route.job)
        elif route.state in ("decoding", "local"):
            # tokens are streaming: the gateway may resume this choice on another worker
            self.routes.pop(key)
            other = {route.decode, route.prefill} - {"", worker_id}
            for wid in other:
                self._send(wid, m.Abort(key[0], "worker lost", key[1]))
            self.outbox.to_gateway(
                req.stream_address,
                m.RequestError(
                    key[0],
                    503,
                    f"worker {worker_id} stopped responding",
                    key[1],
                    retryable=True,
                ),
            )
        else:
            self._fail(key, 503, f"worker {worker_id} stopped responding")

    def _register(self, info: m.Register, now: float) -> None:
        known = self.registry.workers.get(info.worker_id)
        if known is not None and known.info == info:
            known.last_seen = now  # workers re-send Register every second
            return
        if known is not None:
            # the same worker id, started again: whatever the old process held is gone
            logger.warning("worker %s restarted", info.worker_id)
            del self.registry.workers[info.worker_id]
            self.outbox.forget_worker(info.worker_id)
            self._reroute_from(info.worker_id)
        try:
            self.registry.register(info, now)
        except LayoutMismatchError as e:
            logger.error("refusing worker %s: %s", info.worker_id, e)
            return
        logger.info("registered %s worker %s for %s", info.role, info.worker_id, info.model)

    def _generate(self, req: m.Generate, now: float) -> None:
        reg = self.registry
        if req.model not in reg.models():
            self._error_to(req, 404, f"the model `{req.model}` does not exist")
            return
        if not reg.ready(req.model):
            self._error_to(req, 503, f"model {req.model} has no prefill and decode workers yet")
            return
        if req.resume_choice is not None:
            self._resume(req)
            return
        for choice in range(req.n):
            if not reg.disaggregated(req.model):
                self._run_colocated(req, choice)
            elif not self._reserve(req, choice):
                return

    def _reserve(self, req: m.Generate, choice: int) -> bool:
        """Ask the decode worker with the most room to hold blocks for this choice."""
        bs = self._block_size(req.model)
        need = -(-(len(req.prompt_token_ids) + 1) // bs)
        worker = self.registry.pick_decode(req.model, need)
        if worker is None:
            key = (req.request_id, choice)
            self._fail(key, 503, "no decode worker has free KV blocks for this prompt", req)
            return False
        self.routes.add(Route(req, choice, "reserving", decode=worker.worker_id))
        msg = m.Reserve(
            req.request_id, req.prompt_token_ids, req.sampling, req.n, req.stream_address, choice
        )
        self._send(worker.worker_id, msg)
        return True

    def _resume(self, req: m.Generate) -> None:
        """A choice migrating off a dead worker: one worker recomputes prompt + tokens so far
        and decodes on (no transfer)."""
        choice = req.resume_choice
        bs = self._block_size(req.model)
        need = -(-(len(req.prompt_token_ids) + len(req.resume_token_ids) + 1) // bs)
        worker = self.registry.pick_decode(req.model, need)
        if worker is None:
            self._error_to(req, 503, "no decode worker can take over this request")
            return
        logger.info(
            "request %s#%d resumes on %s after %d tokens",
            req.request_id,
            choice,
            worker.worker_id,
            len(req.resume_token_ids),
        )
        self._run_local(req, choice, worker.worker_id, list(req.resume_token_ids))

    def _run_colocated(self, req: m.Generate, choice: int) -> None:
        worker = self.registry.pick_colocated(req.model, len(req.prompt_token_ids))
        if worker is None:
            self._error_to(req, 503, f"model {req.model} has no worker")
            return
        self.outbox.to_gateway(req.stream_address, m.Accepted(req.request_id, choice))
        self._run_local(req, choice, worker.worker_id)

    def _run_local(
        self, req: m.Generate, choice: int, worker_id: str, generated: list[int] | None = None
    ) -> None:
        """One worker runs both phases of this choice (no transfer), after ``generated``."""
        self.routes.add(Route(req, choice, "local", decode=worker_id, prefill=worker_id))
        job = m.PrefillJob(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            req.n,
            worker_id,
            [],
            "",
            req.stream_address,
            choice,
            generated or [],
        )
        self._send(worker_id, job)

    def _reserved(self, msg: m.Reserved, now: float) -> None:
        key = (msg.request_id, msg.choice)
        route = self.routes.get(key)
        if route is None or route.state != "reserving":
            # aborted meanwhile: give the blocks back
            self._send(msg.worker_id, m.Abort(msg.request_id, "no longer wanted", msg.choice))
            return
        if msg.error is not None:
            self._fail(key, 503, f"decode worker {msg.worker_id} could not reserve: {msg.error}")
            return
        req = route.request
        prefill = self.registry.pick_prefill(req.model, len(req.prompt_token_ids))
        if prefill is None:
            self._fail(key, 503, f"model {req.model} has no prefill worker")
            return
        route.state, route.prefill = "prefilling", prefill.worker_id
        self.outbox.to_gateway(req.stream_address, m.Accepted(req.request_id, msg.choice))
        route.job = m.PrefillJob(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            req.n,
            msg.worker_id,
            msg.block_ids,
            msg.transfer_address,
            req.stream_address,
            msg.choice,
        )
        self._send(prefill.worker_id, route.job)

    def _transfer_done(self, msg: m.TransferDone, now: float) -> None:
        route = self.routes.get((msg.request_id, msg.choice))
        if route is None or route.state != "prefilling":
            return
        route.state = "decoding"
        self._send(route.decode, msg)

    def _finished(self, msg: m.Finished, now: float) -> None:
        key = (msg.request_id, msg.choice)
        route = self.routes.get(key)
        if route is None:
            return
        if route.state == "prefilling" and msg.worker_id == route.prefill:
            # token 0 ended the choice: the decode worker's reservation is not needed
            self._send(route.decode, m.Abort(msg.request_id, "finished at token 0", msg.choice))
        self.routes.pop(key)

    def _abort(self, msg: m.Abort, now: float) -> None:
        for key in self.routes.keys_of(msg.request_id, msg.choice):
            route = self.routes.pop(key)
            for worker_id in {route.decode, route.prefill} - {""}:
                self._send(worker_id, m.Abort(msg.request_id, msg.reason, route.choice))

    def _worker_error(self, msg: m.RequestError, now: float) -> None:
        # the worker told the gateway already; stop the other side of every choice
        for key in self.routes.keys_of(msg.request_id, None):
            route = self.routes.pop(key)
            for worker_id in {route.decode, route.prefill} - {""}:
                self._send(worker_id, m.Abort(msg.request_id, msg.message, route.choice))

    # ---- helpers ----------------------------------------------------------------------------
    def _fail(self, key: Key, status: int, message: str, req: m.Generate | None = None) -> None:
        """End a request on every worker its choices touched and tell its gateway."""
        route = self.routes.get(key)
        request = req or (route.request if route else None)
        if request is None:
            return
        for k in self.routes.keys_of(key[0], None):
            r = self.routes.pop(k)
            for worker_id in {r.decode, r.prefill} - {""}:
                self._send(worker_id, m.Abort(key[0], message, r.choice))
        self._error_to(request, status, message)

    def _error_to(self, req: m.Generate, status: int, message: str) -> None:
        logger.info("request %s: %d %s", req.request_id, status, message)
        self.outbox.to_gateway(req.stream_address, m.RequestError(req.request_id, status, message))

    def _send(self, worker_id: str, msg: m.Message) -> None:
        worker = self.registry.workers.get(worker_id)
        if worker is not None:
            self.outbox.to_worker(worker_id, worker.info.control_address, msg)

    def _block_size(self, model: str) -> int:
        return next(
            w.info.layout.block_size
            for w in self.registry.workers.values()
            if w.info.model == model
        )
