"""The routes on which one worker runs both phases, no transfer: conditional disaggregation (a
short uncached prompt, or a busy prefill pool, goes to its decode worker to prefill itself: the
``ConditionalDisaggPolicy`` decides), a colocated pool, and a choice resuming on another worker
after its own died (prompt + tokens so far recomputed there)."""

from __future__ import annotations

import logging

from pdserve.coordinator.disagg_policy import ConditionalDisaggPolicy, LocalReason
from pdserve.coordinator.placement import Placement
from pdserve.coordinator.routes import Route, RouteState
from pdserve.coordinator.shared import Shared
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import fork_blocks, resume_blocks

logger = logging.getLogger(__name__)


class LocalPrefill:
    """Owns the ``local`` routes: which requests one worker prefills and decodes itself, the
    ``PrefillJob`` with no destination sent there, and the ``Accepted`` for each choice."""

    def __init__(
        self, shared: Shared, placement: Placement, policy: ConditionalDisaggPolicy
    ) -> None:
        self.shared = shared
        self.placement = placement
        self.policy = policy

    def prefill_on_decode(self, req: m.Generate) -> LocalReason | None:
        """Conditional disaggregation: why the request went to a decode worker to prefill
        itself rather than through a transfer; None when it did not (the policy says no, or
        no decode worker has room now: the usual path queues it)."""
        if not self.policy.enabled:
            return None
        shared, prompt = self.shared, req.prompt_token_ids
        reason = self.policy.reason(
            prompt_tokens=len(prompt),
            # the part of the prompt its decode worker would compute: a conversation's next
            # turn is short even when its history is long
            decode_cached_tokens=self.placement.decode_hit_tokens(req.model, prompt),
            prefill_queue_tokens=shared.registry.prefill_queue_tokens(req.model, shared.avoid()),
        )
        if reason is None:
            return None
        need = fork_blocks(len(prompt), req.n, shared.registry.block_size(req.model))
        worker = self.placement.pick_decode(req.model, need, shared.avoid(), prompt)
        if worker is None:
            return None
        self._run_local(req, worker.worker_id)
        return reason

    def resume(self, req: m.Generate, choice: int) -> None:
        """A choice migrating off a dead worker: one worker recomputes prompt + tokens so far
        and decodes on (no transfer)."""
        block_size = self.shared.registry.block_size(req.model)
        need = resume_blocks(len(req.prompt_token_ids), len(req.resume_token_ids), block_size)
        worker = self.placement.pick_decode(req.model, need, ())
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
        self._run_local(req, worker.worker_id, choice, list(req.resume_token_ids))

    def run_colocated(self, req: m.Generate) -> None:
        """A pool whose workers all run both phases: the least busy one takes the request."""
        worker = self.shared.registry.pick_colocated(req.model, len(req.prompt_token_ids))
        if worker is None:
            self.shared.error_to(req, 503, f"model {req.model} has no worker")
            return
        self._run_local(req, worker.worker_id)

    def _run_local(
        self, req: m.Generate, worker_id: str, choice: int = 0, generated: list[int] | None = None
    ) -> None:
        """One worker runs both phases (no transfer): of every choice, prefilled once and
        forked there; or, ``generated`` given, of ``choice`` alone after those tokens."""
        shared = self.shared
        members = [choice] if generated is not None else list(range(req.n))
        for c in members:
            route = Route(req, c, RouteState.LOCAL, decode=worker_id, prefill=worker_id)
            shared.routes.add(route)
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
        )
        shared.send(worker_id, job)
