"""Prefill worker: runs prompts, streams token 0, pushes the KV into the decode worker's blocks.

One record per job (``PrefillRecord``: a prompt run for one choice, or once for several) in one
table, ``records``, keyed by the ``ChoiceKey`` of the job's first choice; its state::

    PrefillJob ─▶ COMPUTING ─every token 0─▶ SENDING ─sender DONE/FAILED─▶ DONE (TransferDone
                   │  (chunked, in            │  push could not start:     sent, blocks released
                   │   the engine)            │  FAILED                    into the prefix cache)
                   │                          │  TransferDone(error): the decode worker's policy
                   │                          │  decides
                   ├─ token 0 ends every choice (eos, stop token, max_tokens=1): final chunks
                   │  to the gateway, Finished to the coordinator, no transfer: DONE
                   └─ Abort (either state): ABORTED

``_free`` is the one way out: the record leaves the table and gives back what it holds, the
engine's KV (held, or the prompt still computing) and the sender's transfer.
Token 0 goes to the gateway the moment it is sampled (that is the TTFT), before the KV moves.
With ``--kv-stream-chunks`` the KV moves in parts while COMPUTING too, a part after each chunk
step (prefill/offers.py); the push SENDING is then the last part, and the transfer ends (DONE,
FAILED) when the decode worker has read them all.
``TransferDone`` goes to the coordinator the moment the sender finishes, from the sender's
thread (``KVSender.notify``): the next step may be a long prompt, and the decode worker must
not wait for it to end. The blocks are released by the worker's own thread, after its step;
its outbox must accept messages from the sender's thread too.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from dataclasses import dataclass, field

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.kvtransfer.base import KVPoll, KVSender
from pdserve.prefill.offers import KVOffers, Offered
from pdserve.protocol import messages as m
from pdserve.protocol.keys import ChoiceKey
from pdserve.protocol.phases import Phase
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tenancy import share_of
from pdserve.worker.base import Worker
from pdserve.worker.wire import (
    Outbox,
    PromptKey,
    TransferStats,
    choice_params,
    token_chunk,
    transfer_id,
)

logger = logging.getLogger(__name__)


class PrefillState(enum.Enum):
    """Where a job is on a prefill worker (the module docstring draws the transitions)."""

    COMPUTING = "computing"  # the prompt runs in the engine (chunked); token 0s arriving
    SENDING = "sending"  # every token 0 is out; the KV is being pushed
    # exits: the record has left the table
    DONE = "done"  # TransferDone sent, or every choice ended at token 0
    FAILED = "failed"  # the push could not start
    ABORTED = "aborted"


@dataclass
class PrefillRecord:
    """One job: its choices' token 0s so far, then its transfer (started when, reported yet)."""

    job: m.PrefillJob
    state: PrefillState = PrefillState.COMPUTING
    firsts: dict[int, RequestOutput] = field(default_factory=dict)  # token 0s, by choice
    done: m.TransferDone | None = None  # what the coordinator is told when the push ends
    transfer_started: float = 0.0  # time.monotonic() when the push began
    # its phases (protocol/phases.py): when it came, when its prompt began computing
    received: float = field(default_factory=time.monotonic)
    computing: float | None = None
    reported: bool = False  # ``done`` has gone out (from either thread)
    offered: Offered = field(default_factory=Offered)  # its KV offered while computing
    # the engine ids of its choices, from the job's first choice on
    group: tuple[ChoiceKey, ...] = field(init=False)

    def __post_init__(self) -> None:
        first = self.job.choice
        members = range(first, first + max(self.job.choices, 1))
        self.group = tuple(ChoiceKey(self.job.request_id, c) for c in members)

    @property
    def key(self) -> ChoiceKey:
        return self.group[0]

    @property
    def held_id(self) -> ChoiceKey | PromptKey:
        """The engine id whose KV is held for the transfer: the choice's, or the prompt's
        that its choices share."""
        if self.job.choices > 1:
            return PromptKey(self.job.request_id, self.job.choice)
        return self.key

    @property
    def transfer_id(self) -> str:
        return transfer_id(self.key)


class PrefillWorker(Worker[PrefillRecord]):
    """A prefill worker: its records, the prompts in its engine and the KV sender."""

    transfers: TransferStats  # KV pushed to decode workers (metrics)

    def __init__(
        self,
        engine: LLMEngine,
        sender: KVSender,
        worker_id: str,
        outbox: Outbox,
        transfer_timeout_s: float = 30.0,
        stream_chunks: bool = False,
    ) -> None:
        super().__init__(engine, worker_id, outbox)
        self.sender = sender
        self.transfers = TransferStats()
        self.transfer_timeout_s = transfer_timeout_s
        # ValueError: streaming chunks with a sender that cannot send in parts
        self.offers = KVOffers(engine, sender, transfer_timeout_s, self.transfers, stream_chunks)
        # the sender's thread reads the table (``_report``): it changes under this lock only
        self._lock = threading.Lock()
        sender.notify(self._report)

    def handle(self, msg: m.Message) -> None:
        if isinstance(msg, m.PrefillJob):
            self._start(msg)
        elif isinstance(msg, m.Abort):
            self.abort(msg.request_id, msg.choice)
        else:
            logger.warning("prefill worker ignores %s", type(msg).__name__)

    def _start(self, job: m.PrefillJob) -> None:
        """The prompt runs once for the job's choices (more than one: under the prompt's own
        id, each choice drawing its token 0 from its last logits, engine/fork.py)."""
        record = PrefillRecord(job)
        # Draining, a job still runs: the coordinator sent it before it heard of the drain
        # (it sends none after), and refusing it would fail a stream another worker could
        # have served; the drain waits for it like for any work in flight.
        try:
            firsts = [_token0_params(choice_params(job.sampling, k.choice)) for k in record.group]
            self.engine.requests.check_prompt(job.prompt_token_ids, job.sampling)
            share, prompt = share_of(job.share), job.prompt_token_ids
            if len(record.group) == 1:
                self.engine.add_request(record.key, prompt, firsts[0], hold_kv=True, share=share)
            else:
                self.engine.forks.add_request_n(
                    record.held_id, record.group, prompt, firsts, hold_kv=True, share=share
                )
        except ValueError as e:
            self._fail(record.key, job.stream_address, 400, str(e))
            return
        with self._lock:
            self.records[record.key] = record

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """The job (one choice, or the choices that share it) or every job of the request;
        held blocks freed now. (The coordinator aborts a shared job by its first choice.)"""
        for key, record in list(self.records.items()):
            if record.job.request_id == request_id and choice in (None, record.job.choice):
                self._free(key, PrefillState.ABORTED)

    def _free(self, key: ChoiceKey, end: PrefillState) -> None:
        """The record leaves the table, ``end`` its last state, and gives back all it holds:
        the engine's KV (held for the push, or the prompt still computing with the choices
        waiting for token 0) and, once it is sending, the sender's transfer."""
        with self._lock:
            record = self.records.pop(key, None)
        if record is None:
            return
        held, record.state = record.state, end
        self.engine.abort(record.held_id)
        if held is PrefillState.SENDING or record.offered.parts:
            self.sender.release(record.transfer_id)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step (prompt chunks), then check transfers in flight."""
        busy = bool(self.keys_in(PrefillState.SENDING))
        if self.engine.has_unfinished():
            self.step_started = time.monotonic()
            for out in self.engine.step():
                self._on_output(out)
            for key in self.keys_in(PrefillState.COMPUTING):  # began computing in this step
                r = self.records[key]
                if r.computing is None and self.prompt_started(r.held_id):
                    r.computing = self.step_started
            self.tokens.flush()
            for key in self.keys_in(PrefillState.COMPUTING) if self.offers.stream else []:
                r = self.records[key]  # KV of the chunks done so far goes now (offers.py)
                self.offers.partial(r.job, r.held_id, r.transfer_id, r.offered)
            busy = True
        self._poll_transfers()
        return busy

    def _on_output(self, out: RequestOutput) -> None:
        """Token 0 of a choice; once every choice of its job has one, the job goes on."""
        key = out.request_id
        if not out.finished or not isinstance(key, ChoiceKey):
            return
        record = next(
            (
                r
                for r in self.records.values()
                if r.state is PrefillState.COMPUTING and key in r.group
            ),
            None,
        )
        if record is None:
            return
        record.firsts[key.choice] = out
        if len(record.firsts) < record.job.choices:
            return
        job, choices = record.job, sorted(record.firsts)
        outs = [record.firsts[c] for c in choices]
        ended = []
        phases = job.phases | self._prompt_phases(record)  # the coordinator's, then its own
        for c, o in zip(choices, outs, strict=True):
            # a choice ends at token 0 if it stopped (or its constraint failed), or if it only
            # wanted one token
            stopped = o.finish_reason in (m.FinishReason.STOP, m.FinishReason.ABORT)
            ends = stopped or job.sampling.max_tokens <= 1  # 0: the prompt scored, no token
            reason = o.finish_reason if ends else None
            key = ChoiceKey(job.request_id, c)
            chunk = token_chunk(key, o, 0, o.new_token_ids[:1], reason, phases)
            self.tokens.add(job.stream_address, chunk)
            if ends:
                ended.append(c)
                self._finished(key)
        if len(ended) == len(outs):
            self._free(record.key, PrefillState.DONE)
            self._trace(record, time.monotonic())
            return
        self._push(record, outs, ended)

    def _prompt_phases(self, record: PrefillRecord) -> dict[str, float]:
        """Its prefill_queue and prefill_compute, now that token 0 is out (a prompt computed
        in one step began with it)."""
        now = time.monotonic()
        computing = record.computing = record.computing or self.step_started
        return {
            Phase.PREFILL_QUEUE: max(0.0, computing - record.received),
            Phase.PREFILL_COMPUTE: max(0.0, now - computing),
        }

    def _trace(self, record: PrefillRecord, end: float, **attributes: str | int | float) -> None:
        """Its span (tracing on): from the job's arrival to the end of its push."""
        job = record.job
        if self.tracer.enabled and job.trace:
            attrs: dict[str, str | int | float | bool] = {
                "pdserve.request_id": job.request_id,
                "pdserve.choice": job.choice,
                "pdserve.worker": self.worker_id,
                "pdserve.prompt_tokens": len(job.prompt_token_ids),
                **attributes,
            }
            self.tracer.span("prefill", job.trace, record.received, end, attrs)

    def _push(self, record: PrefillRecord, outs: list[RequestOutput], ended: list[int]) -> None:
        """Start moving the held KV (what is left of it) to the decode worker's blocks:
        SENDING."""
        job = record.job
        lps = [o.new_logprobs for o in outs]
        done = m.TransferDone(
            request_id=job.request_id,
            first_token_ids=[o.new_token_ids[0] for o in outs],
            first_logprobs=[lp[0] for lp in lps] if all(lps) else None,
            num_cached_tokens=outs[0].num_cached_tokens,
            choice=job.choice,
            ended=ended,
        )
        with self._lock:  # first: the sender may finish before send returns
            record.state, record.done = PrefillState.SENDING, done
            record.transfer_started = time.monotonic()
        try:  # the decode worker's prefix cache holds its leading ``skip_blocks`` already
            self.offers.final(job, record.held_id, record.transfer_id, record.offered)
        except Exception as e:  # any transport failure fails this transfer only
            self.kv_failures += 1
            self._free(record.key, PrefillState.FAILED)
            error = f"KV transfer could not start: {e}"
            self.outbox.to_coordinator(dataclasses.replace(done, error=error))

    def _report(self, transfer: str, state: KVPoll) -> None:
        """Send ``TransferDone`` for a finished transfer, once, from whichever thread sees it
        first. A failed push still hands token 0 over: the decode worker's policy decides."""
        with self._lock:
            record = next(
                (
                    r
                    for r in self.records.values()
                    if r.state is PrefillState.SENDING and r.transfer_id == transfer
                ),
                None,
            )
            if record is None or record.done is None or record.reported:
                return
            record.reported = True
            now = time.monotonic()
            seconds = now - record.transfer_started
            self.transfers.ended(seconds)
            if state is not KVPoll.DONE:
                self.kv_failures += 1
            done = record.done
        reason = self.sender.failure_reason(transfer)
        error = None if state is KVPoll.DONE else f"KV transfer failed: {reason}"
        phases: dict[str, float] = {Phase.KV_TRANSFER: max(0.0, seconds)}
        self.outbox.to_coordinator(dataclasses.replace(done, error=error, phases=phases))
        self._trace(record, now, **{"pdserve.kv_transfer_s": seconds})

    def _poll_transfers(self) -> None:
        for key in self.keys_in(PrefillState.SENDING):
            record = self.records.get(key)
            if record is None:
                continue
            state = self.sender.poll(record.transfer_id)
            if not state.finished:
                continue
            self._report(record.transfer_id, state)  # unless the sender's thread did already
            self._free(key, PrefillState.DONE)

    @property
    def blocks_sent(self) -> int:
        return self.transfers.blocks


def _token0_params(params: SamplingParams) -> SamplingParams:
    """Token 0 only (none for a prompt only scored); ``min_tokens`` still keeps eos away from
    it when asked to."""
    return dataclasses.replace(
        params, max_tokens=min(params.max_tokens, 1), min_tokens=min(params.min_tokens, 1)
    )
