"""How a request's choices reach their decode worker, one of two ways::

    reserved   the decode worker with the most room and cache gets a ``Reserve``; a prefill
               worker computes the prompt once it answers (``Reservations``). With no blocks
               free now, the choice queues (``RouteTable.queued``: tier first, then the
               tenants' fair shares, then priority and arrival; bounded by the
               ``AdmissionPolicy``, a full queue refusing its lowest tier first) until
               heartbeats and ticks show blocks back; a refusal asks another decode worker.
    local      one worker runs both phases, no transfer (``LocalPrefill``): a prompt only
               scored (``max_tokens`` 0, on a prefill worker: no decode blocks), conditional
               disaggregation (a short uncached prompt, or a busy prefill pool, goes to its
               decode worker to prefill itself: the ``ConditionalDisaggPolicy`` decides), a
               colocated pool, a model with no live prefill worker (degraded: its decode
               workers prefill), a prompt whose prefill worker died with no other left (its
               decode worker recomputes it), and a choice resuming on another worker after its
               own died (prompt + tokens so far recomputed there).

Either way the worker is ``Placement``'s pick, and the choice's route (``coordinator.routes``)
says which way it went.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from pdserve.coordinator.placement import Placement
from pdserve.coordinator.policies import AdmissionPolicy, ConditionalDisaggPolicy, LocalReason
from pdserve.coordinator.routes import Route, RouteState, Shared
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import fork_blocks, resume_blocks
from pdserve.protocol.keys import ChoiceKey
from pdserve.protocol.phases import Phase
from pdserve.protocol.tenancy import share_of

logger = logging.getLogger(__name__)


class Reservations:
    """Owns the routes from ``queued`` to the answer of their decode worker (``reserving``):
    the queue of choices waiting for blocks, the ``Reserve`` sent, the ``Reserved`` taken (its
    free count into the worker's estimate), and a reservation asked again elsewhere when one
    is refused, times out or its worker dies."""

    def __init__(self, shared: Shared, placement: Placement, admission: AdmissionPolicy) -> None:
        self.shared = shared
        self.placement = placement
        self.admission = admission

    def blocks_for(self, req: m.Generate, choices: int) -> int:
        """Decode blocks ``choices`` forked choices start with (``protocol.blocks``)."""
        block_size = self.placement.block_size(req.model)
        return fork_blocks(len(req.prompt_token_ids), choices, block_size)

    def reserve(
        self,
        req: m.Generate,
        choice: int,
        now: float,
        tried: set[str] | None = None,
        why: str = "",
    ) -> bool:
        """Ask the decode worker with the most room (none of ``tried``, none silent) to hold
        blocks for this choice (choice 0: for every choice of the request, which go as one);
        ``why`` the last one did not. False: the request failed."""
        shared = self.shared
        choices = req.n if choice == 0 else 1
        need = self.blocks_for(req, choices)
        tried = tried or set()
        avoid = tried | shared.avoid(now)
        prompt, max_tokens = req.prompt_token_ids, req.sampling.max_tokens
        worker = self.placement.pick_decode(req.model, need, avoid, prompt, max_tokens)
        if worker is None:
            return self._queue(req, choice, choices, need, why, now)
        arrived = shared.arrival(req, now)
        route = Route.reserving(req, choice, choices, need, worker.worker_id, tried, now, arrived)
        shared.routes.add(route)
        self._send_reserve(route)
        return True

    def _queue(
        self, req: m.Generate, choice: int, choices: int, need: int, why: str, now: float
    ) -> bool:
        """The pool is full for now: wait for blocks to come back, in the queue's order; or
        fail. A full queue makes room by refusing its newest choice of a lower tier (503:
        it was not accepted yet, nothing of it runs), if it has one."""
        shared = self.shared
        queue = shared.routes.queued
        decoder = self.placement.has_decoder(req.model, shared.avoid(now))
        if decoder and not self.admission.can_queue(len(queue), decoder):
            shed = queue.newest_below(share_of(req.share).tier)
            if shed is not None:
                why_shed = "the queue for decode blocks is full: a higher tier's request came"
                shared.fail(shed.key, 503, why_shed, shed.request)
        if self.admission.can_queue(len(queue), decoder):
            arrived = shared.arrival(req, now)
            shared.routes.add(Route.queued(req, choice, choices, need, now, arrived))
            logger.info("request %s#%d: queued (%s)", req.request_id, choice, why or "full")
            return True
        message = "no decode worker has free KV blocks for this prompt"
        key = ChoiceKey(req.request_id, choice)
        shared.fail(key, 503, f"{why}; {message}" if why else message, req)
        return False

    def place_queued(self, now: float) -> None:
        """Reserve for waiting choices, in the queue's order, while decode blocks allow."""
        shared = self.shared
        avoid = shared.avoid(now)
        queue = shared.routes.queued
        while queue:
            route = queue.peek()
            req = route.request
            prompt, max_tokens = req.prompt_token_ids, req.sampling.max_tokens
            worker = self.placement.pick_decode(req.model, route.need, avoid, prompt, max_tokens)
            if worker is None:
                return  # in order: no later, smaller one jumps the queue
            queue.pop()
            route.reserve_on(worker.worker_id, now)
            self._send_reserve(route)

    def answered(self, msg: m.Reserved, now: float) -> Route | None:
        """A decode worker's answer: the route that now holds its blocks, to prefill; None
        when there is nothing more to do (a late answer given back, a refusal asked
        elsewhere)."""
        shared = self.shared
        key = ChoiceKey(msg.request_id, msg.choice)
        route = shared.routes.get(key)
        shared.silent.heard(msg.worker_id)
        in_flight = self.reserving_on(msg.worker_id, but=key)
        self.placement.free_blocks_answered(msg.worker_id, msg.free_blocks, in_flight)
        if (
            route is None
            or route.state is not RouteState.RESERVING
            or route.decode != msg.worker_id
        ):
            # aborted meanwhile, or a late answer after the choice moved: give the blocks back
            if msg.error is None:
                abort = m.Abort(
                    request_id=msg.request_id, reason="no longer wanted", choice=msg.choice
                )
                shared.send(msg.worker_id, abort)
            return None
        if msg.error is not None:
            why = f"decode worker {msg.worker_id} could not reserve: {msg.error}"
            logger.info("request %s: %s", key, why)
            shared.routes.pop(key)
            self.reserve(route.request, route.choice, now, route.tried | {msg.worker_id}, why)
            return None
        return route

    def reserving_on(self, worker_id: str, but: ChoiceKey) -> int:
        """Blocks asked of ``worker_id`` by reservations it has not answered yet, but ``but``."""
        return sum(
            r.need
            for r in self.shared.routes.in_state(RouteState.RESERVING)
            if r.decode == worker_id and r.key != but
        )

    def _send_reserve(self, route: Route) -> None:
        req = route.request
        msg = m.Reserve(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            n=req.n,
            stream_address=req.stream_address,
            choice=route.choice,
            choices=route.choices,
            share=req.share,
            trace=self.shared.trace_for(req, route.choice),
        )
        self.shared.send(route.decode, msg)


class LocalPrefill:
    """Owns the ``local`` routes: which requests one worker prefills and decodes itself, the
    ``PrefillJob`` with no destination sent there, and the ``Accepted`` for each choice."""

    def __init__(
        self,
        shared: Shared,
        placement: Placement,
        policy: ConditionalDisaggPolicy,
        threshold: Callable[[str], int | None] = lambda model: None,
    ) -> None:
        self.shared = shared
        self.placement = placement
        self.policy = policy
        self.threshold = threshold  # the planner's local-prefill threshold per model, if set

    def policy_for(self, model: str) -> ConditionalDisaggPolicy:
        """The policy with the planner's threshold for ``model`` where it sets one."""
        limit = self.threshold(model)
        if limit is None:
            return self.policy
        return dataclasses.replace(self.policy, max_local_prefill_tokens=limit)

    def prefill_on_decode(
        self, req: m.Generate, now: float, forced: LocalReason | None = None
    ) -> LocalReason | None:
        """Conditional disaggregation: why the request went to a decode worker to prefill
        itself rather than through a transfer (``forced``: that reason, whatever the policy);
        None when it did not (the policy says no, or no decode worker has room now: the usual
        path queues it)."""
        policy = self.policy_for(req.model)
        if forced is None and not policy.enabled:
            return None
        shared, prompt = self.shared, req.prompt_token_ids
        reason = forced or policy.reason(
            prompt_tokens=len(prompt),
            # the part of the prompt its decode worker would compute: a conversation's next
            # turn is short even when its history is long
            decode_cached_tokens=self.placement.decode_hit_tokens(req.model, prompt),
            prefill_queue_tokens=self.placement.prefill_queue_tokens(req.model, shared.avoid(now)),
        )
        if reason is None:
            return None
        need = fork_blocks(len(prompt), req.n, self.placement.block_size(req.model))
        max_tokens = req.sampling.max_tokens
        worker = self.placement.pick_decode(req.model, need, shared.avoid(now), prompt, max_tokens)
        if worker is None:
            return None
        self._run_local(req, worker.worker_id, now)
        return reason

    def instead_of_transfer(self, route: Route, why: str, now: float) -> None:
        """No prefill worker can compute ``route``'s prompt (``why``): the decode worker
        holding its blocks gives them back and prefills it itself, every choice of the request
        from the start (a token 0 the lost prefill worker already streamed comes again and the
        gateway drops the repeat). A route for only some choices fails (503)."""
        shared, req = self.shared, route.request
        if route.choice != 0 or route.choices != req.n or not route.decode:
            shared.fail(route.key, 503, f"{why}; no other prefill worker can take it")
            return
        decode = route.decode
        logger.warning("request %s: %s; its decode worker %s prefills it", route.key, why, decode)
        shared.routes.pop(route.key)
        abort = m.Abort(request_id=req.request_id, reason="prefilled here", choice=route.choice)
        shared.send(route.decode, abort)  # the same socket, in order: freed before the job
        self._run_local(req, route.decode, now)

    def resume(self, req: m.Generate, choice: int, now: float) -> None:
        """A choice migrating off a dead worker: one worker recomputes prompt + tokens so far
        and decodes on (no transfer)."""
        block_size = self.placement.block_size(req.model)
        need = resume_blocks(len(req.prompt_token_ids), len(req.resume_token_ids), block_size)
        # a stream already running: any worker whose cache can hold it takes it, and its
        # engine makes room (preempting by policy) rather than the stream failing
        worker = self.placement.pick_decode(req.model, need, (), room=False)
        if worker is None:
            self.shared.error_to(req, 503, "no decode worker can take over this request")
            return
        logger.info(
            "request %s#%d resumes on %s after %d tokens",
            req.request_id,
            choice,
            worker.worker_id,
            len(req.resume_token_ids),
        )
        self._run_local(req, worker.worker_id, now, choice, list(req.resume_token_ids))

    def score(self, req: m.Generate, now: float) -> None:
        """``max_tokens`` 0: the prompt is only scored (its logprobs) and nothing decodes: a
        prefill worker runs it, no decode blocks reserved; with none, a decode worker
        prefills it itself."""
        shared, prompt = self.shared, req.prompt_token_ids
        avoid = shared.avoid(now)
        worker = self.placement.pick_prefill(req.model, prompt, avoid)
        if worker is None:
            need = fork_blocks(len(prompt), 1, self.placement.block_size(req.model))
            worker = self.placement.pick_decode(req.model, need, avoid, prompt, 0)
        if worker is None:
            shared.error_to(req, 503, f"model {req.model} has no worker free for this prompt")
            return
        self._run_local(req, worker.worker_id, now)

    def run_colocated(self, req: m.Generate, now: float) -> None:
        """A pool whose workers all run both phases: the least busy one takes the request."""
        worker = self.placement.pick_colocated(req.model, len(req.prompt_token_ids))
        if worker is None:
            self.shared.error_to(req, 503, f"model {req.model} has no worker")
            return
        self._run_local(req, worker.worker_id, now)

    def _run_local(
        self,
        req: m.Generate,
        worker_id: str,
        now: float,
        choice: int = 0,
        generated: list[int] | None = None,
    ) -> None:
        """One worker runs both phases (no transfer): of every choice, prefilled once and
        forked there; or, ``generated`` given, of ``choice`` alone after those tokens."""
        shared = self.shared
        members = [choice] if generated is not None else list(range(req.n))
        arrived = shared.arrival(req, now)  # before now: it was held, a wait to report
        for c in members:
            shared.routes.add(Route.local(req, c, worker_id, now, arrived))
            if generated is None:  # a resumed choice's gateway knows it is accepted
                accepted = m.Accepted(request_id=req.request_id, choice=c)
                shared.outbox.to_gateway(req.stream_address, accepted)
        job = m.PrefillJob(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
            n=req.n,
            dst_block_ids=[],
            transfer_address="",
            stream_address=req.stream_address,
            choice=choice,
            generated_token_ids=generated or [],
            choices=len(members),
            share=req.share,
            trace=shared.trace_for(req, choice),
            phases={Phase.COORDINATOR_WAIT: now - arrived} if arrived < now else {},
        )
        shared.send(worker_id, job)
        shared.traced(req, choice, arrived, now, worker_id, worker_id)
