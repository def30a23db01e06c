"""Prefill worker: runs prompts, streams token 0, pushes the KV into the decode worker's blocks.

Lifecycle of one choice (``key = request_id#choice``), each in exactly one dict::

    PrefillJob ──▶ computing ──token 0──▶ sending ──sender DONE──▶ (gone: TransferDone sent,
                     │  (chunked, in        │                      blocks released into the
                     │   the engine)        │ FAILED               prefix cache)
                     │                      ▼
                     │              TransferDone(error): the decode worker's policy decides
                     └─ token 0 ends the request (eos, stop token, max_tokens=1):
                        final chunk to the gateway, Finished to the coordinator, no transfer

Token 0 goes to the gateway the moment it is sampled (that is the TTFT), before the KV moves.
``TransferDone`` goes to the coordinator the moment the sender finishes, from the sender's
thread (``KVSender.notify``): the next step may be a long prompt, and the decode worker must
not wait for it to end. The blocks are released by the worker's own thread, after its step.
``PrefillWorker`` has no sockets: ``handle`` takes a message, ``step`` runs one engine step;
its outbox must accept messages from the sender's thread too.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.kvtransfer.base import KVPoll, KVSender, TransferSpec
from pdserve.protocol import messages as m
from pdserve.worker.wire import (
    Outbox,
    TokenBatcher,
    TransferStats,
    block_bytes,
    choice_params,
    engine_key,
    prompt_key,
)

logger = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(
        self,
        engine: LLMEngine,
        sender: KVSender,
        worker_id: str,
        outbox: Outbox,
        transfer_timeout_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.outbox = outbox
        self.tokens = TokenBatcher(outbox)  # this step's token 0s, one message per gateway
        self.transfers = TransferStats()  # KV pushed to decode workers (metrics)
        self._block_bytes = block_bytes(engine)
        self._started: dict[str, float] = {}  # sending key -> when its push began
        self.draining = False
        self.transfer_timeout_s = transfer_timeout_s
        self.computing: dict[str, m.PrefillJob] = {}
        self.sending: dict[str, tuple[m.PrefillJob, m.TransferDone]] = {}
        self._reported: set[str] = set()  # sending keys whose TransferDone has gone out
        self._report_lock = threading.Lock()  # the sender's thread reports too
        self._group: dict[str, str] = {}  # a shared job's choice ids -> the job's key
        self._firsts: dict[str, dict[int, RequestOutput]] = {}  # token 0s so far, by job
        sender.notify(self._report)

    def handle(self, msg: m.Message) -> None:
        if isinstance(msg, m.PrefillJob):
            self._start(msg)
        elif isinstance(msg, m.Abort):
            self.abort(msg.request_id, msg.choice)
        else:
            logger.warning("prefill worker ignores %s", type(msg).__name__)

    def _start(self, job: m.PrefillJob) -> None:
        """The prompt runs once for the job's choices (``choices`` > 1: under ``prompt_key``,
        each choice drawing its token 0 from its last logits, engine/fork.py)."""
        if self.draining:
            self._fail(job, 503, "worker is draining")
            return
        key = engine_key(job.request_id, job.choice)
        members = range(job.choice, job.choice + max(job.choices, 1))
        try:
            firsts = []
            for c in members:
                params = choice_params(job.sampling, c)
                # token 0 only; min_tokens still keeps eos away from it when asked to
                firsts.append(
                    dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
                )
            self.engine.check_prompt(job.prompt_token_ids, params)
            if len(members) == 1:
                self.engine.add_request(key, job.prompt_token_ids, firsts[0], hold_kv=True)
            else:
                ids = [engine_key(job.request_id, c) for c in members]
                self.engine.add_request_n(
                    _held_id(job), ids, job.prompt_token_ids, firsts, hold_kv=True
                )
                self._group.update((i, key) for i in ids)
        except ValueError as e:
            self._fail(job, 400, str(e))
            return
        self.computing[key] = job
        self._firsts[key] = {}

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """The job (one choice, or the choices that share it) or every job of the request;
        held blocks freed now. (The coordinator aborts a shared job by its first choice.)"""
        for table in (self.computing, self.sending):
            for key, value in list(table.items()):
                job = _job(value)
                if job.request_id != request_id or choice not in (None, job.choice):
                    continue
                with self._report_lock:
                    del table[key]
                    self._reported.discard(key)
                    self._started.pop(key, None)
                self._forget(key, job)
                self.engine.abort(_held_id(job))  # frees held blocks, and waiting choices
                self.sender.release(key)

    def _forget(self, key: str, job: m.PrefillJob) -> None:
        self._firsts.pop(key, None)
        for c in range(job.choice + 1, job.choice + job.choices):
            self._group.pop(engine_key(job.request_id, c), None)
        self._group.pop(key, None)

    def step(self) -> bool:
        """One engine step (prompt chunks), then check transfers in flight."""
        busy = bool(self.sending)
        if self.engine.has_unfinished():
            for out in self.engine.step():
                self._on_output(out)
            self.tokens.flush()
            busy = True
        self._poll_transfers()
        return busy

    def _on_output(self, out: RequestOutput) -> None:
        """Token 0 of a choice; once every choice of its job has one, the job goes on."""
        key = self._group.get(out.request_id, out.request_id)
        job = self.computing.get(key)
        if job is None or not out.finished:
            return
        firsts = self._firsts[key]
        firsts[int(out.request_id.rsplit("#", 1)[1])] = out
        if len(firsts) < job.choices:
            return
        del self.computing[key]
        self._forget(key, job)
        outs = [firsts[c] for c in sorted(firsts)]
        ended = []
        for c, o in zip(sorted(firsts), outs, strict=True):
            # a choice ends at token 0 if it stopped (or its constraint failed), or if it only
            # wanted one token
            ends = o.finish_reason in ("stop", "abort") or job.sampling.max_tokens == 1
            self.tokens.add(job.stream_address, _first_chunk(job, c, o, ends))
            if ends:
                ended.append(c)
                self.outbox.to_coordinator(m.Finished(job.request_id, c, self.worker_id))
        held = _held_id(job)
        if len(ended) == len(outs):
            self.engine.release(held)
            return
        src = self.engine.held_block_ids(held)
        lps = [o.new_logprobs for o in outs]
        done = m.TransferDone(
            job.request_id,
            [o.new_token_ids[0] for o in outs],
            [lp[0] for lp in lps] if all(lps) else None,
            outs[0].num_cached_tokens,
            job.choice,
            ended=ended,
        )
        # the decode worker holds the leading ``skip_blocks`` already (its prefix cache)
        skip = min(max(job.skip_blocks, 0), len(src) - 1)
        spec = TransferSpec(
            key,
            src[skip:],
            job.dst_block_ids[skip : len(src)],
            job.transfer_address,
            self.transfer_timeout_s,
            job.transfer_secret,
        )
        self.transfers.started(len(spec.src_block_ids), self._block_bytes)
        self._started[key] = time.monotonic()
        self.sending[key] = (job, done)  # first: the sender may finish before send returns
        try:
            self.sender.send(spec, self.engine.kv_layers)
        except Exception as e:  # any transport failure fails this transfer only
            with self._report_lock:
                del self.sending[key]
                self._reported.discard(key)
                self._started.pop(key, None)
            self.engine.release(held)
            error = f"KV transfer could not start: {e}"
            self.outbox.to_coordinator(dataclasses.replace(done, error=error))

    def _report(self, key: str, state: KVPoll) -> None:
        """Send ``TransferDone`` for a finished transfer, once, from whichever thread sees it
        first. A failed push still hands token 0 over: the decode worker's policy decides."""
        with self._report_lock:
            entry = self.sending.get(key)
            if entry is None or key in self._reported:
                return
            self._reported.add(key)
            self.transfers.ended(time.monotonic() - self._started.pop(key, time.monotonic()))
        reason = self.sender.failure_reason(key)
        error = None if state is KVPoll.DONE else f"KV transfer failed: {reason}"
        self.outbox.to_coordinator(dataclasses.replace(entry[1], error=error))

    def _poll_transfers(self) -> None:
        for key in list(self.sending):
            state = self.sender.poll(key)
            if not state.finished:
                continue
            self._report(key, state)  # unless the sender's thread did already
            with self._report_lock:
                job = self.sending.pop(key)[0]
                self._reported.discard(key)
            self.sender.release(key)
            self.engine.release(_held_id(job))

    def _fail(self, job: m.PrefillJob, status: int, message: str) -> None:
        logger.warning("request %s#%d failed: %s", job.request_id, job.choice, message)
        error = m.RequestError(job.request_id, status, message)
        self.tokens.flush()
        self.outbox.to_gateway(job.stream_address, error)
        self.outbox.to_coordinator(error)

    @property
    def blocks_sent(self) -> int:
        return self.transfers.blocks

    def begin_drain(self) -> None:
        """Finish what is here; new work is turned away (the coordinator stops sending it)."""
        self.draining = True

    def in_flight(self) -> bool:
        return bool(self.computing or self.sending)

    @property
    def queued_prompt_tokens(self) -> int:
        return self.engine.queued_prompt_tokens


def _job(value: m.PrefillJob | tuple[m.PrefillJob, m.TransferDone]) -> m.PrefillJob:
    return value[0] if isinstance(value, tuple) else value


def _held_id(job: m.PrefillJob) -> str:
    """The engine id whose KV is held for the transfer: the choice's, or the prompt's that
    its choices share."""
    if job.choices > 1:
        return prompt_key(job.request_id, job.choice)
    return engine_key(job.request_id, job.choice)


def _first_chunk(job: m.PrefillJob, choice: int, out: RequestOutput, ends: bool) -> m.TokenChunk:
    return m.TokenChunk(
        request_id=job.request_id,
        choice=choice,
        index=0,
        token_ids=out.new_token_ids[:1],
        logprobs=out.new_logprobs or None,
        finished=ends,
        finish_reason=out.finish_reason if ends else None,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )
