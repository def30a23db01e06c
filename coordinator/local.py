"""The routes on which one worker runs both phases, no transfer (``Coordinator`` mixes it in):
conditional disaggregation (a short uncached prompt, or a busy prefill pool, goes to its decode
worker to prefill itself), a colocated pool, and a choice resuming on another worker after its
own died (prompt + tokens so far recomputed there)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from pdserve.coordinator.routes import Route, RouteTable
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import resume_blocks

if TYPE_CHECKING:
    from pdserve.coordinator.coordinator import CoordinatorOutbox
    from pdserve.coordinator.placement import Placement
    from pdserve.coordinator.registry import WorkerRegistry

logger = logging.getLogger(__name__)


class LocalPrefill:
    outbox: CoordinatorOutbox
    registry: WorkerRegistry
    placement: Placement
    routes: RouteTable
    decisions: Counter[str]
    max_local_prefill_tokens: int
    max_prefill_queue_tokens: int

    if TYPE_CHECKING:  # provided by Coordinator or another of its mixins

        def _send(self, worker_id: str, msg: m.Message) -> None: ...
        def _error_to(self, req: m.Generate, status: int, message: str) -> None: ...
        def _block_size(self, model: str) -> int: ...
        def _silent(self) -> set[str]: ...

    def _prefill_on_decode(self, req: m.Generate) -> bool:
        """Conditional disaggregation: whether the request went to a decode worker to prefill
        itself (short prompt, or a busy prefill pool) rather than through a transfer."""
        reason = self._local_reason(req)
        if reason is None:
            self.decisions["disaggregated"] += req.n
            return False
        need = self._blocks_for(req, req.n)
        worker = self.placement.pick_decode(req.model, need, self._silent(), req.prompt_token_ids)
        if worker is None:  # no room anywhere now: the usual path queues it
            self.decisions["disaggregated"] += req.n
            return False
        self.decisions[reason] += req.n
        self._run_local(req, worker.worker_id)
        return True

    def _local_reason(self, req: m.Generate) -> str | None:
        if self.max_local_prefill_tokens > 0 and req.prompt_token_ids:
            # the part of the prompt its decode worker would compute: a conversation's next
            # turn is short even when its history is long
            hit = self.placement.decode_hit_tokens(req.model, req.prompt_token_ids)
            if len(req.prompt_token_ids) - hit <= self.max_local_prefill_tokens:
                return "local_short_prompt"
        if self.max_prefill_queue_tokens > 0:
            queued = self.registry.prefill_queue_tokens(req.model, self._silent())
            if queued is not None and queued > self.max_prefill_queue_tokens:
                return "local_prefill_busy"
        return None

    def _resume(self, req: m.Generate) -> None:
        """A choice migrating off a dead worker: one worker recomputes prompt + tokens so far
        and decodes on (no transfer)."""
        choice = req.resume_choice
        bs = self._block_size(req.model)
        need = resume_blocks(len(req.prompt_token_ids), len(req.resume_token_ids), bs)
        worker = self.placement.pick_decode(req.model, need, ())
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
        self._run_local(req, worker.worker_id, choice, list(req.resume_token_ids))

    def _run_colocated(self, req: m.Generate) -> None:
        worker = self.registry.pick_colocated(req.model, len(req.prompt_token_ids))
        if worker is None:
            self._error_to(req, 503, f"model {req.model} has no worker")
            return
        self._run_local(req, worker.worker_id)

    def _run_local(
        self, req: m.Generate, worker_id: str, choice: int = 0, generated: list[int] | None = None
    ) -> None:
        """One worker runs both phases (no transfer): of every choice, prefilled once and
        forked there; or, ``generated`` given, of ``choice`` alone after those tokens."""
        members = [choice] if generated is not None else list(range(req.n))
        for c in members:
            self.routes.add(Route(req, c, "local", decode=worker_id, prefill=worker_id))
            if generated is None:  # a resumed choice's gateway knows it is accepted
                self.outbox.to_gateway(req.stream_address, m.Accepted(req.request_id, c))
        job = m.PrefillJob(
            req.request_id,
            req.prompt_token_ids,
            req.sampling,
            req.n,
            [],
            "",
            req.stream_address,
            choice,
            generated or [],
            choices=len(members),
        )
        self._send(worker_id, job)
