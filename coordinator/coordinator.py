"""The coordinator: pairs each request's choices with a decode and a prefill worker.

Route of one choice (``(request_id, choice)``)::

    Generate ─▶ reserving ──Reserved(ids)──▶ prefilling ──TransferDone──▶ decoding ──Finished─▶ ·
       │ (colocated pool: PrefillJob        │ Reserved(error)  │ Finished (token 0 ended it):
       │  straight to one worker ─▶ local)  ▼ 503 to gateway   ▼ Abort the decode reservation
    Abort from the gateway, RequestError from a worker, or a worker's death: every worker the
    route touches gets an Abort, and the request's gateway a RequestError (it drops the ones
    for requests it ended itself), so no Abort, genuine or forged, leaves a stream silent.

Conditional disaggregation: a prompt whose part not cached on its decode worker (``kv``
routing: the worker holding most of it) is at most ``max_local_prefill_tokens`` tokens, or any
prompt while every prefill worker has more than ``max_prefill_queue_tokens`` queued, is
prefilled by its decode worker itself (a ``PrefillJob`` with no destination: no transfer);
0 turns either rule off. ``decisions`` counts each choice's route by reason.

Every wait has a bound: a decode worker that does not answer ``Reserve`` within
``reserve_timeout_s`` (or refuses it) is passed over for another one; a prefill job with no
``TransferDone`` within ``prefill_timeout_s`` moves to another prefill worker. With no other
worker the request fails (503), logged with its id. A request that can never fit the largest
decode worker's whole KV cache fails at once (400), not with a retryable 503.

``Coordinator`` has no sockets: ``handle`` takes a message, ``tick`` expires dead workers,
and everything it says goes through a ``CoordinatorOutbox``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from typing import Protocol

from pdserve.coordinator.capacity import too_big
from pdserve.coordinator.local import LocalPrefill
from pdserve.coordinator.placement import HOT_SPOT_TOKENS, Placement
from pdserve.coordinator.recovery import Recovery
from pdserve.coordinator.registry import Worker, WorkerRegistry
from pdserve.coordinator.reserve import DecodeReservation
from pdserve.coordinator.routes import Key, Route, RouteTable
from pdserve.kvtransfer.base import LayoutMismatchError
from pdserve.protocol import messages as m

logger = logging.getLogger(__name__)


class CoordinatorOutbox(Protocol):
    def to_worker(self, worker_id: str, address: str, msg: m.Message) -> None: ...

    def to_gateway(self, address: str, msg: m.Message) -> None: ...

    def forget_worker(self, worker_id: str) -> None: ...


class Coordinator(Recovery, LocalPrefill, DecodeReservation):
    def __init__(
        self,
        outbox: CoordinatorOutbox,
        heartbeat_timeout_s: float = 5.0,
        *,
        reserve_timeout_s: float = 5.0,
        prefill_timeout_s: float = 120.0,
        queue_timeout_s: float = 60.0,
        max_queued: int = 4096,
        max_local_prefill_tokens: int = 0,
        max_prefill_queue_tokens: int = 0,
        routing: str = "kv",
        hot_spot_tokens: int = HOT_SPOT_TOKENS,
    ) -> None:
        timeouts = (
            ("reserve", reserve_timeout_s),
            ("prefill", prefill_timeout_s),
            ("queue", queue_timeout_s),
        )
        for name, value in timeouts:
            if not value > 0:
                raise ValueError(f"the {name} timeout must be > 0 s, got {value}")
        self.outbox = outbox
        self.registry = WorkerRegistry(heartbeat_timeout_s)
        self.routes = RouteTable()
        self.reserve_timeout_s = reserve_timeout_s
        self.prefill_timeout_s = prefill_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.max_queued = max_queued
        if max_local_prefill_tokens < 0 or max_prefill_queue_tokens < 0:
            raise ValueError("the local-prefill thresholds must be >= 0 (0: off)")
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.max_prefill_queue_tokens = max_prefill_queue_tokens
        self.decisions: Counter[str] = Counter()  # routing decisions by reason
        # which worker of a pool (prefill choices counted by reason, beside ``decisions``)
        self.placement = Placement(self.registry, routing, hot_spot_tokens)
        # workers that let a reservation or a prefill job time out -> when; passed over for
        # new work until they answer again or ``SILENT_HOLD_S`` has passed
        self.silent: dict[str, float] = {}
        self._now = 0.0

    # ---- messages ---------------------------------------------------------------------------
    def handle(self, msg: m.Message, now: float, sender: str = "") -> None:
        """``sender``: the CURVE identity the message came with (``protocol.security``)."""
        if not self.registry.admit(msg, sender):
            return
        handler = {
            m.Register: self._register,
            m.Heartbeat: self._heartbeat,
            m.KVEvents: lambda e, _t: self.registry.kv_events(e),
            m.GatewayHello: lambda h, _t: self.outbox.to_gateway(
                h.stream_address,
                dataclasses.replace(self.registry.cluster_state(), routing=self._routing()),
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
        self._now = now
        handler(msg, now)

    def _routing(self) -> dict[str, int]:
        """Every routing decision by reason: each choice's route, each prefill placement."""
        placement = self.placement
        return dict(self.decisions + placement.decisions + placement.decode_decisions)

    def _heartbeat(self, hb: m.Heartbeat, now: float) -> None:
        if self.registry.heartbeat(hb, now):
            self._place_queued()  # its free blocks are known afresh

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
        self.silent.pop(info.worker_id, None)  # a new process: nothing of the old one's holds
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
        error = too_big(reg, req)
        if error is not None:
            self._error_to(req, 400, error)
            return
        if req.resume_choice is not None:
            self._resume(req)
            return
        # the n choices go as one: one prefill, forked where they decode (DESIGN.md)
        if not reg.disaggregated(req.model):
            self.decisions["colocated"] += req.n
            self._run_colocated(req)
        elif not self._prefill_on_decode(req):
            self._reserve(req, 0)

    def _reserved(self, msg: m.Reserved, now: float) -> None:
        key = (msg.request_id, msg.choice)
        route = self.routes.get(key)
        self.silent.pop(msg.worker_id, None)
        in_flight = self._reserving_on(msg.worker_id, but=key)
        self.registry.free_blocks_answered(msg.worker_id, msg.free_blocks, in_flight)
        if route is None or route.state != "reserving" or route.decode != msg.worker_id:
            # aborted meanwhile, or a late answer after the choice moved: give the blocks back
            if msg.error is None:
                self._send(msg.worker_id, m.Abort(msg.request_id, "no longer wanted", msg.choice))
            return
        if msg.error is not None:
            why = f"decode worker {msg.worker_id} could not reserve: {msg.error}"
            logger.info("request %s#%d: %s", key[0], key[1], why)
            self.routes.pop(key)
            self._reserve(route.request, route.choice, route.tried | {msg.worker_id}, why)
            return
        req = route.request
        prefill = self._pick_prefill(req, set())
        if prefill is None:
            self._fail(key, 503, f"model {req.model} has no prefill worker")
            return
        route.state, route.prefill, route.since = "prefilling", prefill.worker_id, self._now
        for c in route.members():
            self.outbox.to_gateway(req.stream_address, m.Accepted(req.request_id, c))
        route.job = m.PrefillJob(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            req.n,
            msg.block_ids,
            msg.transfer_address,
            req.stream_address,
            msg.choice,
            transfer_secret=msg.transfer_secret,
            skip_blocks=msg.cached_blocks,
            choices=route.choices,
        )
        self._send(prefill.worker_id, route.job)

    def _transfer_done(self, msg: m.TransferDone, now: float) -> None:
        key = (msg.request_id, msg.choice)
        route = self.routes.get(key)
        if route is None or route.state != "prefilling":
            return
        ended = route.ended | set(msg.ended)
        self.routes.pop(key)
        for c in route.members():  # from here on each choice goes its own way
            if c not in ended:
                self.routes.add(
                    Route(route.request, c, "decoding", route.decode, route.prefill, since=now)
                )
        self._send(route.decode, dataclasses.replace(msg, ended=sorted(ended)))

    def _finished(self, msg: m.Finished, now: float) -> None:
        route = self.routes.covering(msg.request_id, msg.choice)
        if route is None:
            return
        key = (msg.request_id, route.choice)
        if route.state == "prefilling" and msg.worker_id == route.prefill:
            # token 0 ended the choice: it does not decode (``TransferDone.ended`` says so
            # too); once every choice has, the decode worker's reservation is not needed
            route.ended.add(msg.choice)
            if len(route.ended) < route.choices:
                return
            self._send(route.decode, m.Abort(msg.request_id, "finished at token 0", route.choice))
        self.routes.pop(key)

    def _abort(self, msg: m.Abort, now: float) -> None:
        gateways = self._drop(msg.request_id, msg.choice, msg.reason)
        # The gateway that asked has dropped the request and ignores this; one that did not
        # ask (an Abort from anyone else) must end its stream, not wait on it.
        error = m.RequestError(msg.request_id, 503, f"aborted: {msg.reason}", msg.choice)
        for address in gateways:
            logger.info("request %s: aborted (%s)", msg.request_id, msg.reason)
            self.outbox.to_gateway(address, error)

    def _worker_error(self, msg: m.RequestError, now: float) -> None:
        # A worker tells the gateway itself; it hears it from here too (the second copy is
        # dropped), so an error sent only to the coordinator never leaves a stream silent.
        gateways = self._drop(msg.request_id, None, msg.message)
        error = m.RequestError(msg.request_id, msg.status, msg.message)
        for address in gateways:
            logger.info("request %s: %d %s", msg.request_id, msg.status, msg.message)
            self.outbox.to_gateway(address, error)

    def _drop(self, request_id: str, choice: int | None, reason: str) -> set[str]:
        """Abort the routes of a request (one choice, or all) on every worker they touch;
        the gateways that were waiting on them."""
        gateways = set()
        for key in self.routes.keys_of(request_id, choice):
            route = self.routes.pop(key)
            gateways.add(route.request.stream_address)
            for worker_id in {route.decode, route.prefill} - {""}:
                self._send(worker_id, m.Abort(request_id, reason, route.choice))
        return gateways

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

    def _reserving_on(self, worker_id: str, but: Key) -> int:
        """Blocks asked of ``worker_id`` by reservations it has not answered yet, but ``but``."""
        return sum(
            r.need
            for k, r in self.routes.items()
            if r.state == "reserving" and r.decode == worker_id and k != but
        )

    def _pick_prefill(self, req: m.Generate, tried: set[str]) -> Worker | None:
        avoid = tried | self._silent()
        return self.placement.pick_prefill(req.model, req.prompt_token_ids, avoid)

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
