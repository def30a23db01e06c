"""The coordinator: pairs each request's choices with a decode and a prefill worker.

Route of one choice (``ChoiceKey``; states ``RouteState``, coordinator.routes)::

    Generate ─▶ reserving ──Reserved(ids)──▶ prefilling ──TransferDone──▶ decoding ──Finished─▶ ·
       │ (colocated pool: PrefillJob        │ Reserved(error)  │ Finished (token 0 ended it):
       │  straight to one worker ─▶ local)  ▼ 503 to gateway   ▼ Abort the decode reservation
    Abort from the gateway, RequestError from a worker, or a worker's death: every worker the
    route touches gets an Abort, and the request's gateway a RequestError (it drops the ones
    for requests it ended itself), so no Abort, genuine or forged, leaves a stream silent.

Conditional disaggregation (``ConditionalDisaggPolicy``): a short uncached prompt, or any while
every prefill worker is busy, is prefilled by its decode worker itself (no transfer).

Degraded, not refused: once a model's pools were whole, a model with no live prefill worker
has its decode workers prefill new requests themselves (decision ``local_no_prefill``); one
with no worker that can decode holds its requests up to ``hold_timeout_s`` for one to come
back (``Holds``); a prefill job whose worker died with no other prefill worker left is
recomputed on the decode worker that holds its blocks (``Recovery``).

Every wait has a bound (``Recovery``): a decode worker that does not answer ``Reserve`` within
``reserve_timeout_s`` (or refuses it) is passed over for another one; a prefill job with no
``TransferDone`` within ``prefill_timeout_s`` moves to another prefill worker. With no other
worker the request fails (503), logged with its id. A request that can never fit the largest
decode worker's whole KV cache fails at once (400), not with a retryable 503
(``AdmissionPolicy``).

``Coordinator`` has no sockets: ``handle`` takes a message, ``tick`` expires dead workers and
waits, and everything it says goes through a ``CoordinatorOutbox``. It holds its parts::

    shared        Shared          registry, routes, silent workers, outbox (routes.py)
    placement     Placement       which worker of a pool; the pools' figures (placement.py)
    reservations  Reservations    decode blocks held, the queue for them (dispatch.py)
    local         LocalPrefill    one worker runs both phases (dispatch.py)
    recovery      Recovery        dead and silent workers, timeouts (recovery.py)
    peers         TransferPeers   whose KV regions each worker knows (nixl; peers.py)
    rollouts      Rollouts        versions behind one name, the canary gate (rollouts.py)

and the decisions, pure objects (policies.py): ``PlacementPolicy``, ``ConditionalDisaggPolicy``,
``AdmissionPolicy``. The workers, and what each may say, are the registry's (registry.py). Each
gateway gets the cluster's state in answer to its hello, and at once when the rollout table
changes (``gateways``: those heard lately).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable

from pdserve.coordinator.canary_gate import GateConfig
from pdserve.coordinator.dispatch import LocalPrefill, Reservations
from pdserve.coordinator.embeds import EmbedRouter
from pdserve.coordinator.holds import DEFAULT_HOLD_S, Holds
from pdserve.coordinator.peers import TransferPeers
from pdserve.coordinator.placement import Placement
from pdserve.coordinator.planner import Planner
from pdserve.coordinator.planning import Planning, default_planner
from pdserve.coordinator.policies import (
    HOT_SPOT_TOKENS,
    MAX_QUEUED,
    AdmissionPolicy,
    ConditionalDisaggPolicy,
    LocalReason,
    RoutingMode,
)
from pdserve.coordinator.recovery import Recovery, Timeouts
from pdserve.coordinator.registry import ModelState, WorkerRegistry
from pdserve.coordinator.rollouts import Rollouts, RolloutTable
from pdserve.coordinator.routes import CoordinatorOutbox, Route, RouteState, RouteTable, Shared
from pdserve.kvtransfer.base import LayoutMismatchError
from pdserve.protocol import messages as m
from pdserve.protocol.control import Heartbeat, KVEvents, Register
from pdserve.protocol.keys import ChoiceKey
from pdserve.protocol.phases import Phase
from pdserve.protocol.rollouts import RolloutCommand

logger = logging.getLogger(__name__)

GATEWAY_QUIET_S = 10.0  # a gateway hellos each second: one quiet this long is gone (no push)
MAX_PUSHED = 64  # gateways pushed a changed rollout table (more hear it with their next hello)


class Coordinator:
    """Owns the flow of one request through its parts (module doc) and ``decisions``: each
    choice's route by reason (``colocated``, ``disaggregated``, ``LocalReason``)."""

    def __init__(
        self,
        outbox: CoordinatorOutbox,
        heartbeat_timeout_s: float = 5.0,
        *,
        reserve_timeout_s: float = 5.0,
        prefill_timeout_s: float = 120.0,
        queue_timeout_s: float = 60.0,
        max_queued: int = MAX_QUEUED,
        max_local_prefill_tokens: int = 0,
        max_prefill_queue_tokens: int = 0,
        routing: str | RoutingMode = RoutingMode.KV,
        hot_spot_tokens: int = HOT_SPOT_TOKENS,
        make_planner: Callable[[str], Planner] = default_planner,
        planner_interval_s: float = 5.0,
        planner_window_s: float = 30.0,
        auto_local: bool = False,
        hold_timeout_s: float = DEFAULT_HOLD_S,
        rollouts: RolloutTable | None = None,
        canary_gate: GateConfig | None = None,
    ) -> None:
        timeouts = Timeouts(reserve_timeout_s, prefill_timeout_s, queue_timeout_s)
        disagg = ConditionalDisaggPolicy(max_local_prefill_tokens, max_prefill_queue_tokens)
        self.shared = Shared(outbox, WorkerRegistry(heartbeat_timeout_s, hold_s=hold_timeout_s))
        self.holds = Holds(hold_timeout_s)
        self.admission = AdmissionPolicy(max_queued)
        self.placement = Placement(self.registry, RoutingMode.parse(routing), hot_spot_tokens)
        self.reservations = Reservations(self.shared, self.placement, self.admission)
        self.planning = Planning(
            self.registry,
            make_planner,
            interval_s=planner_interval_s,
            window_s=planner_window_s,
            auto_local=auto_local,
            queued=self._queued,
        )
        self.local = LocalPrefill(self.shared, self.placement, disagg, self.planning.threshold)
        self.peers = TransferPeers(self.shared)
        parts = (self.shared, self.placement, self.reservations, timeouts, self.peers, self.local)
        self.recovery = Recovery(*parts)
        self.embeds = EmbedRouter(self.shared.outbox, self.shared.registry)
        self.rollouts = Rollouts(
            self.shared.outbox, self.registry, rollouts, canary_gate, changed=self._push_state
        )
        self.gateways: dict[str, float] = {}  # each gateway's stream address -> its last hello
        self.decisions: Counter[str] = Counter()  # each choice's route by reason
        self.started_at: float | None = None  # its first message: then it knows no worker

    @property
    def registry(self) -> WorkerRegistry:
        return self.shared.registry

    @property
    def routes(self) -> RouteTable:
        return self.shared.routes

    # ---- messages ---------------------------------------------------------------------------
    def handle(self, msg: m.Message, now: float, sender: str = "") -> None:
        """``sender``: the CURVE identity the message came with (``runtime.security``)."""
        if not self.registry.admit(msg, sender):
            return
        if not isinstance(msg, HANDLED):
            logger.warning("coordinator ignores %s", type(msg).__name__)
            return
        self.started_at = now if self.started_at is None else self.started_at
        if isinstance(msg, Register):
            self._register(msg, now)
            self._run_held(now)
        elif isinstance(msg, Heartbeat):
            if self.registry.heartbeat(msg, now):
                self.reservations.place_queued(now)  # its free blocks are known afresh
        elif isinstance(msg, KVEvents):
            self.registry.kv_events(msg)
        elif isinstance(msg, m.GatewayHello):
            self.planning.heard(msg, now)
            self.rollouts.heard(msg, now)
            self._heard_gateway(msg.stream_address, now)
            self.shared.outbox.to_gateway(msg.stream_address, self._state())
        elif isinstance(msg, m.Generate):
            self._generate(msg, now)
        elif isinstance(msg, m.Embed):
            self.embeds.route(msg, msg.model in self.registry.models())
        elif isinstance(msg, m.Reserved):
            route = self.reservations.answered(msg, now)
            if route is not None:
                self._start_prefill(route, msg, now)
        elif isinstance(msg, m.TransferDone):
            self._transfer_done(msg, now)
        elif isinstance(msg, m.Finished):
            if not self.embeds.ended(msg.request_id):
                self._finished(msg)
        elif isinstance(msg, m.Abort):
            if not self.embeds.abort(msg):
                self._abort(msg)
        elif isinstance(msg, RolloutCommand):  # from an admin key (runtime.gate)
            self.rollouts.command(msg)
        elif not self.embeds.ended(msg.request_id):  # an embed worker told its gateway
            self._worker_error(msg)

    def tick(self, now: float) -> None:
        """Expire dead workers and waits past their bound; place what waits for blocks."""
        self.recovery.expire_workers(now)
        self.embeds.lost()
        self.recovery.expire_waits(now)
        self.reservations.place_queued(now)
        self._run_held(now)
        self.planning.tick(now)
        self.rollouts.tick(now)

    def _state(self) -> m.ClusterState:
        """The cluster as gateways see it: workers and models, routing, plans, rollouts."""
        return dataclasses.replace(
            self.registry.cluster_state(),
            routing=self._routing(),
            plans=self.planning.reports(),
            rollouts=self.rollouts.rollouts(),
        )

    def _heard_gateway(self, address: str, now: float) -> None:
        """Keep the gateways heard lately (a bounded few), those ``_push_state`` sends to."""
        self.gateways = {a: t for a, t in self.gateways.items() if now - t <= GATEWAY_QUIET_S}
        if address in self.gateways or len(self.gateways) < MAX_PUSHED:
            self.gateways[address] = now

    def _push_state(self) -> None:
        """The rollout table changed: every gateway heard lately gets the state now."""
        state = self._state()
        for address in self.gateways:
            self.shared.outbox.to_gateway(address, state)

    def _queued(self, model: str) -> int:
        """Choices of ``model`` waiting for decode blocks."""
        return sum(r.request.model == model for r in self.routes.in_state(RouteState.QUEUED))

    def _routing(self) -> dict[str, int]:
        """Every routing decision by reason: each choice's route, each prefill placement."""
        placement = self.placement
        return dict(self.decisions + placement.decisions + placement.decode_decisions)

    def _register(self, info: Register, now: float) -> None:
        known = self.registry.workers.get(info.worker_id)
        if known is not None and known.info == info:
            known.last_seen = now  # workers re-send Register every second
            return
        if known is not None:
            # the same worker id, started again: whatever the old process held is gone
            logger.warning("worker %s restarted", info.worker_id)
            del self.registry.workers[info.worker_id]
            self.shared.outbox.forget_worker(info.worker_id)
            self.recovery.reroute_from(info.worker_id, now)
            self.embeds.lost()  # the requests the old process had
        self.shared.silent.heard(info.worker_id)  # a new process: nothing of the old one's
        try:
            self.registry.register(info, now)
        except LayoutMismatchError as e:
            logger.error("refusing worker %s: %s", info.worker_id, e)
            return
        logger.info("registered %s worker %s for %s", info.role, info.worker_id, info.model)
        self.peers.joined(info)

    def _run_held(self, now: float) -> None:
        """Place the held requests whose model can take them now; fail those held too long."""
        if not len(self.holds):
            return
        reg = self.registry
        holding = ModelState.HOLDING
        runnable, expired = self.holds.take(lambda model: reg.state(model) is not holding, now)
        for held in runnable:  # its coordinator_wait (and span) counts from when it was held
            self.shared.held_since[held.request.request_id] = held.since
            try:
                self._generate(held.request, now)
            finally:
                del self.shared.held_since[held.request.request_id]
        for held in expired:
            waited = now - held.since
            why = f"model {held.request.model} had no worker to take it for {waited:.1f} s"
            self.shared.error_to(held.request, 503, why)

    def _generate(self, req: m.Generate, now: float) -> None:
        reg, shared = self.registry, self.shared
        state = reg.state(req.model)
        if state is ModelState.HOLDING:  # a worker is away (restarting): wait, a bounded while
            if not self.holds.hold(req, now):
                shared.error_to(req, 503, f"model {req.model} has no worker to take it now")
            else:
                logger.info("request %s: held (no worker for %s now)", req.request_id, req.model)
            return
        if req.model not in reg.models():
            # until every live worker has registered again (a restarted coordinator), an
            # unknown model may only be one whose workers it has not heard yet: retryable
            if now - (self.started_at or now) < reg.heartbeat_timeout_s:
                shared.error_to(req, 503, f"model {req.model} has no workers yet")
            else:
                shared.error_to(req, 404, f"the model `{req.model}` does not exist")
            return
        if reg.embeds(req.model):
            why = f"model `{req.model}` is an embedding model: use /v1/embeddings"
            shared.error_to(req, 400, why)
            return
        if state is ModelState.ABSENT:
            shared.error_to(req, 503, f"model {req.model} has no prefill and decode workers yet")
            return
        self.planning.arrived(req, now)
        blocks, block_size = self.placement.decode_capacity(req.model)
        error = self.admission.too_big(
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.sampling.max_tokens,
            max_model_len=self.placement.max_model_len(req.model),
            decode_blocks=blocks,
            block_size=block_size,
            choices=1 if req.resume_choice is not None else req.n,
        )
        if error is not None:
            shared.error_to(req, 400, error)
            return
        if req.resume_choice is not None:
            self.local.resume(req, req.resume_choice, now)
            return
        # the n choices go as one: one prefill, forked where they decode (engine/fork.py)
        if state is ModelState.NO_PREFILL:
            reason = self.local.prefill_on_decode(req, now, LocalReason.NO_PREFILL)
            self.decisions[reason.value if reason is not None else "disaggregated"] += req.n
            if reason is None:  # no room now: it queues, and is prefilled where it decodes
                self.reservations.reserve(req, 0, now)
            return
        if not self.placement.disaggregated(req.model):
            self.decisions["colocated"] += req.n
            self.local.run_colocated(req, now)
            return
        if req.sampling.max_tokens == 0:  # only the prompt's logprobs: nothing decodes
            self.decisions["scored"] += req.n
            self.local.score(req, now)
            return
        reason = self.local.prefill_on_decode(req, now)
        self.decisions[reason.value if reason is not None else "disaggregated"] += req.n
        if reason is None:
            self.reservations.reserve(req, 0, now)

    def _start_prefill(self, route: Route, msg: m.Reserved, now: float) -> None:
        """The decode worker holds the blocks (``msg``): a prefill worker computes the prompt
        and pushes its KV there."""
        req, shared = route.request, self.shared
        avoid = shared.avoid(now)
        prefill = self.placement.pick_prefill(req.model, req.prompt_token_ids, avoid)
        if prefill is None:  # the prefill pool is gone: the decode worker prefills it itself
            self.local.instead_of_transfer(route, f"model {req.model} has no prefill worker", now)
            return
        for c in route.members():
            accepted = m.Accepted(request_id=req.request_id, choice=c)
            shared.outbox.to_gateway(req.stream_address, accepted)
        job = m.PrefillJob(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            n=req.n,
            dst_block_ids=msg.block_ids,
            transfer_address=msg.transfer_address,
            stream_address=req.stream_address,
            choice=msg.choice,
            transfer_secret=msg.transfer_secret,
            skip_blocks=msg.cached_blocks,
            choices=route.choices,
            share=req.share,
            trace=shared.trace_for(req, msg.choice),
            phases={Phase.COORDINATOR_WAIT: now - route.arrived},  # queued + reserving
        )
        route.prefill_on(prefill.worker_id, job, now)
        shared.send(prefill.worker_id, job)
        shared.traced(req, msg.choice, route.arrived, now, route.decode, prefill.worker_id)

    def _transfer_done(self, msg: m.TransferDone, now: float) -> None:
        key = ChoiceKey(msg.request_id, msg.choice)
        route = self.routes.get(key)
        if route is None or route.state is not RouteState.PREFILLING:
            return
        ended = route.ended | set(msg.ended)
        self.routes.pop(key)
        for decoding in route.decoding(ended, now):  # from here on each choice its own way
            self.routes.add(decoding)
        self.shared.send(route.decode, dataclasses.replace(msg, ended=sorted(ended)))

    def _finished(self, msg: m.Finished) -> None:
        route = self.routes.covering(msg.request_id, msg.choice)
        if route is None:
            return
        if route.state is RouteState.PREFILLING and msg.worker_id == route.prefill:
            # token 0 ended the choice: it does not decode (``TransferDone.ended`` says so
            # too); once every choice has, the decode worker's reservation is not needed
            route.ended.add(msg.choice)
            if len(route.ended) < route.choices:
                return
            abort = m.Abort(
                request_id=msg.request_id, reason="finished at token 0", choice=route.choice
            )
            self.shared.send(route.decode, abort)
        self.routes.pop(route.key)

    def _abort(self, msg: m.Abort) -> None:
        gateways = self.shared.drop(msg.request_id, msg.choice, msg.reason)
        gateways |= {held.stream_address for held in self.holds.drop(msg.request_id)}
        # The gateway that asked has dropped the request and ignores this; one that did not
        # ask (an Abort from anyone else) must end its stream, not wait on it.
        error = m.RequestError(
            request_id=msg.request_id,
            status=503,
            message=f"aborted: {msg.reason}",
            choice=msg.choice,
        )
        for address in gateways:
            logger.info("request %s: aborted (%s)", msg.request_id, msg.reason)
            self.shared.outbox.to_gateway(address, error)

    def _worker_error(self, msg: m.RequestError) -> None:
        # A worker tells the gateway itself; it hears it from here too (the second copy is
        # dropped), so an error sent only to the coordinator never leaves a stream silent.
        gateways = self.shared.drop(msg.request_id, None, msg.message)
        error = m.RequestError(request_id=msg.request_id, status=msg.status, message=msg.message)
        for address in gateways:
            logger.info("request %s: %d %s", msg.request_id, msg.status, msg.message)
            self.shared.outbox.to_gateway(address, error)


# the messages the coordinator acts on; any other is logged and dropped
HANDLED = (
    Register,
    Heartbeat,
    KVEvents,
    m.GatewayHello,
    m.Generate,
    m.Embed,
    m.Reserved,
    m.TransferDone,
    m.Finished,
    m.Abort,
    m.RequestError,
    RolloutCommand,
)
