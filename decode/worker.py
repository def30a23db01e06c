"""Decode worker: takes over requests whose prompt KV another worker pushed into its blocks.

One record per choice (decode/record.py ``DecodeRecord``) in one table, ``records``, keyed by
``ChoiceKey``; its state::

    Reserve ─▶ RESERVED ─TransferDone─▶ RECEIVING ─receiver DONE─▶ RUNNING ─engine done─▶ FINISHED
                  │                         │                        │
                  │ Abort       → ABORTED   │ FAILED, timeout:       │ Abort → ABORTED
                  │ no KV in time → FAILED  │ FAILED (recompute: a   │
                  ▼                         ▼ RUNNING record again)  ▼
                       (out of the table: ``_free`` gave back all it held)

``_free`` is the one way out: it gives back everything the record holds, the engine's
reservation (a sequence WAITING_FOR_REMOTE_KVS) or its running sequence, and the receiver's
expectation of the KV. A reservation may serve several choices (one prompt moved here for them
all): the first choice's record stands for them until the KV has landed, then each choice
still wanted runs under a record of its own.

A worker of role ``both`` (colocated mode) also takes a ``PrefillJob`` (no destination
blocks): the whole request runs here, token 0 included, under RUNNING records from the start.
"""

from __future__ import annotations

import logging
import time

from pdserve.decode.record import PENDING, DecodeRecord, DecodeState, KVFailurePolicy
from pdserve.engine.block_manager import NoFreeBlocks
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.kvtransfer.base import KVPoll, KVReceiver
from pdserve.protocol import messages as m
from pdserve.protocol.blocks import blocks_for
from pdserve.protocol.keys import ChoiceKey
from pdserve.protocol.phases import Phase
from pdserve.worker.base import Worker
from pdserve.worker.wire import Outbox, PromptKey, choice_params, token_chunk, transfer_id

logger = logging.getLogger(__name__)


class DecodeWorker(Worker[DecodeRecord]):
    """A decode (or colocated) worker: its records, its engine's reservations and the KV
    receiver that fills them."""

    def __init__(
        self,
        engine: LLMEngine,
        receiver: KVReceiver | None,
        worker_id: str,
        outbox: Outbox,
        transfer_timeout_s: float = 30.0,
        kv_failure_policy: KVFailurePolicy | str = KVFailurePolicy.RECOMPUTE,
    ) -> None:
        super().__init__(engine, worker_id, outbox)
        self.kv_failure_policy = KVFailurePolicy(kv_failure_policy)  # else ValueError
        self.receiver = receiver
        self.transfer_timeout_s = transfer_timeout_s
        self._prompts: set[ChoiceKey] = set()  # run here, not computing yet (their phases)

    # ---- messages ---------------------------------------------------------------------------
    def handle(self, msg: m.Message) -> None:
        if isinstance(msg, m.Reserve):
            self._reserve(msg)
        elif isinstance(msg, m.TransferDone):
            self._transfer_done(msg)
        elif isinstance(msg, m.PrefillJob):
            self._run_locally(msg)
        elif isinstance(msg, m.Abort):
            self.abort(msg.request_id, msg.choice)
        else:
            logger.warning("decode worker ignores %s", type(msg).__name__)

    def _reserve(self, msg: m.Reserve) -> None:
        if self.draining:
            self._answer(msg, error="worker is draining")
            return
        record = DecodeRecord.of(msg)
        key = record.key
        try:
            self.engine.requests.check_prompt(msg.prompt_token_ids, msg.sampling, record.choices)
            # leading blocks this worker's prefix cache holds are shared, not moved again
            ids, cached = self.engine.handoff.reserve_prompt(
                key, msg.prompt_token_ids, record.choices
            )
        except (ValueError, NoFreeBlocks) as e:
            self._answer(msg, error=str(e))
            return
        record.num_local_cached_tokens = cached * (block_size := self.engine.status.block_size)
        secret = b""  # the sender must present it (kvtransfer.base.KVReceiver.expect)
        if self.receiver is not None:
            # the KV of the prompt fills the leading blocks; the last one is for token 0 on
            prompt_blocks = blocks_for(len(msg.prompt_token_ids), block_size)
            try:  # a tensor-parallel group's KV lands in staging blocks first: the sender
                # addresses those (the ids it is given are where it writes)
                dst = self.engine.handoff.incoming(key, ids[cached:prompt_blocks])
            except NoFreeBlocks as e:
                self.engine.handoff.cancel_reservation(key)
                self._answer(msg, error=str(e))
                return
            secret = self.receiver.expect(transfer_id(key), dst, self.transfer_timeout_s)
            ids = ids[:cached] + dst + ids[prompt_blocks:]
        self.records[key] = record
        self._answer(msg, ids, secret=secret, cached_blocks=cached)

    def _answer(
        self,
        msg: m.Reserve,
        block_ids: list[int] | None = None,
        error: str | None = None,
        secret: bytes = b"",
        cached_blocks: int = 0,
    ) -> None:
        """``Reserved``: the blocks (or why none), and the free blocks the coordinator's
        estimate follows."""
        reply = m.Reserved(
            request_id=msg.request_id,
            worker_id=self.worker_id,
            block_ids=block_ids or [],
            transfer_address=self.receiver.address if self.receiver is not None else "",
            error=error,
            choice=msg.choice,
            free_blocks=self.engine.status.num_free_blocks,
            transfer_secret=secret,
            cached_blocks=cached_blocks,
        )
        self.outbox.to_coordinator(reply)

    def _transfer_done(self, msg: m.TransferDone) -> None:
        key = ChoiceKey(msg.request_id, msg.choice)
        record = self.records.get(key)
        if record is None or record.state is not DecodeState.RESERVED:
            logger.warning("transfer done for unknown request %s", key)
            return
        record.first_tokens = list(msg.first_token_ids)
        record.first_logprobs = msg.first_logprobs
        record.num_cached_tokens = msg.num_cached_tokens
        record.dropped.update(msg.ended)
        record.carried, record.decode_from = dict(msg.phases), time.monotonic()
        lps, n = record.first_logprobs, record.choices
        if len(record.first_tokens) != n or (lps and len(lps) != n):
            self._free(key, DecodeState.FAILED)
            message = f"token 0 of {n} choices expected, not so many"
            self._fail(key, record.stream_address, 500, message)
            return
        if msg.error is not None:
            self._transfer_failed(key, record, msg.error)
            return
        record.state = DecodeState.RECEIVING

    def _run_locally(self, msg: m.PrefillJob) -> None:
        """No transfer: the prompt runs here, once for all its choices, each forked from it
        (engine/fork.py); or one choice continues after the tokens it streamed elsewhere."""
        record = DecodeRecord.of(msg)
        if self.draining:
            self._fail(record.key, record.stream_address, 503, "worker is draining")
            return
        keys = {c: ChoiceKey(msg.request_id, c) for c in record.going()}
        params = [choice_params(msg.sampling, c) for c in keys]
        prompt = msg.prompt_token_ids
        try:
            if msg.generated_token_ids:  # a stream moving here from a dead worker
                pending = self.records.get(record.key)
                if pending is not None and pending.state is DecodeState.RUNNING:
                    # this worker was taken for dead (heartbeats missed) but never stopped: the
                    # stream goes on here, and its gateway drops the tokens it already has
                    logger.info("%s: a resume of a stream it still runs: goes on", record.key)
                    return
                if pending is not None and pending.state in PENDING:  # its reservation is moot
                    self._free(record.key, DecodeState.ABORTED)
                self.engine.handoff.add_continuation(
                    record.key, prompt, msg.generated_token_ids, params[0], share=record.share
                )
            elif len(keys) == 1:
                self.engine.add_request(record.key, prompt, params[0], share=record.share)
            else:
                prompt_id = PromptKey(msg.request_id, msg.choice)
                self.engine.forks.add_request_n(
                    prompt_id, list(keys.values()), prompt, params, share=record.share
                )
        except ValueError as e:
            self._fail(record.key, record.stream_address, 400, str(e))
            return
        for c, key in keys.items():
            self.records[key] = record.one(c)
            if record.prompt_at is not None:
                self._prompts.add(key)

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """One choice (or every one) of the request, whatever its state; blocks freed now.
        A choice that shares a reservation it does not lead is only kept from decoding."""
        for key, record in list(self.records.items()):
            if record.request_id != request_id:
                continue
            if record.state in PENDING:
                if choice is not None and choice != record.choice and choice in record.going():
                    record.dropped.add(choice)
                if choice in (None, record.choice) or not record.going():
                    self._free(key, DecodeState.ABORTED)
            elif choice in (None, record.choice):
                self._free(key, DecodeState.ABORTED)

    def _free(self, key: ChoiceKey, end: DecodeState) -> None:
        """The record leaves the table, ``end`` its last state, and gives back all it holds:
        the engine's reservation or sequence (unless the engine finished it), and the
        receiver's expectation of the KV."""
        record = self.records.pop(key, None)
        self._prompts.discard(key)
        if record is None:
            return
        held, record.state = record.state, end
        if not (held is DecodeState.RUNNING and end is DecodeState.FINISHED):
            self.engine.abort(key)
        if held in PENDING and self.receiver is not None:
            self.receiver.release(transfer_id(key))

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit choices whose KV has landed, run one engine step, stream what it produced.
        Returns whether there was anything to do."""
        self._admit_received()
        if not self.engine.has_unfinished():
            return bool(self.keys_in(DecodeState.RECEIVING))
        self.step_started = time.monotonic()
        for out in self.engine.step():
            self._emit(out)
        for key in list(self._prompts):  # began computing in this step, or token 0 is out
            record = self.records.get(key)
            if record is None or record.prompt_at is None:
                self._prompts.discard(key)
            elif self.prompt_started(key):
                record.computing = self.step_started
                self._prompts.discard(key)
        self.tokens.flush()
        return True

    def _admit_received(self) -> None:
        self._expire_reservations()
        for key in self.keys_in(DecodeState.RECEIVING):
            record = self.records.get(key)
            if record is None or record.state is not DecodeState.RECEIVING:
                continue  # gone with another choice of its request meanwhile
            if self.receiver is None:
                self._kv_landed(key, record)
                continue
            state = self.receiver.poll(transfer_id(key))
            if state is KVPoll.FAILED:
                self.kv_failures += 1  # found here (a failed push, its prefill worker counts)
                self._transfer_failed(key, record, self.receiver.failure_reason(transfer_id(key)))
            elif state is KVPoll.DONE:
                self._kv_landed(key, record)

    def _kv_landed(self, key: ChoiceKey, record: DecodeRecord) -> None:
        """The prompt's KV is here: each choice still wanted decodes after its token 0, under
        a RUNNING record of its own."""
        going = record.going()
        if not going:  # each ended at token 0, or was aborted meanwhile
            self._free(key, DecodeState.FINISHED)
            return
        firsts = [record.first_of(c) for c in going]
        try:  # one prompt's KV, forked into each choice that goes on (engine/fork.py)
            self.engine.handoff.add_prefilled_n(
                key,
                [ChoiceKey(record.request_id, c) for c in going],
                record.prompt_token_ids,
                [token for token, _ in firsts],
                [choice_params(record.sampling, c) for c in going],
                [lp for _, lp in firsts],
                num_cached_tokens=max(record.num_cached_tokens, record.num_local_cached_tokens),
                share=record.share,
            )
        except ValueError as e:  # the reservation is freed
            self._free(key, DecodeState.FAILED)
            self._fail(key, record.stream_address, 500, f"could not start decoding: {e}")
            return
        del self.records[key]
        if self.receiver is not None:
            self.receiver.release(transfer_id(key))
        for c in going:
            self.records[ChoiceKey(record.request_id, c)] = record.one(c)

    def _expire_reservations(self) -> None:
        """A reservation nobody followed up (its prefill worker and the coordinator both gone):
        the coordinator normally sends TransferDone or Abort well within this time."""
        now = time.monotonic()
        for key in self.keys_in(DecodeState.RESERVED):
            record = self.records[key]
            if now - record.reserved_at > 3 * self.transfer_timeout_s:
                self._free(key, DecodeState.FAILED)
                self._fail(key, record.stream_address, 503, "the prompt's KV never arrived")

    def _transfer_failed(self, key: ChoiceKey, record: DecodeRecord, reason: str | None) -> None:
        """The reservation is given back; RECOMPUTE: prefill the prompt (and token 0) here
        instead, each choice under a RUNNING record; FAIL: end the request."""
        self._free(key, DecodeState.FAILED)
        if self.kv_failure_policy is KVFailurePolicy.FAIL:
            self._fail(key, record.stream_address, 500, f"KV transfer failed: {reason}")
            return
        logger.warning("KV transfer for %s failed (%s): recomputing locally", key, reason)
        for c in record.going():
            k = ChoiceKey(record.request_id, c)
            try:
                params = choice_params(record.sampling, c)
                token, _ = record.first_of(c)
                self.engine.handoff.add_continuation(
                    k, record.prompt_token_ids, [token], params, share=record.share
                )
            except ValueError as e:
                self.abort(record.request_id)
                message = f"KV transfer failed ({reason}); recompute failed: {e}"
                self._fail(key, record.stream_address, 500, message)
                return
            self.records[k] = record.one(c)

    def _emit(self, out: RequestOutput) -> None:
        key = out.request_id
        record = self.records.get(key) if isinstance(key, ChoiceKey) else None
        if record is None or record.state is not DecodeState.RUNNING:
            return
        if out.finished:
            self._free(record.key, DecodeState.FINISHED)
            self._finished(record.key)
            self._trace(record, out)
            if out.finish_reason is m.FinishReason.ABORT:
                return
        index = out.num_output_tokens - len(out.new_token_ids)
        timed = record.decode_from is not None or record.prompt_at is not None
        phases = self._phases(record, index) if timed else None
        chunk = token_chunk(record.key, out, index, out.new_token_ids, out.finish_reason, phases)
        self.tokens.add(record.stream_address, chunk)

    def _phases(self, record: DecodeRecord, index: int) -> dict[str, float] | None:
        """This worker's phases of a choice, on its first chunk of each: run here, token 0's
        prefill_queue and prefill_compute (with the coordinator's); then its first decode step
        (with what the prefill worker reported: kv_transfer)."""
        now = time.monotonic()
        if record.prompt_at is not None and index == 0:
            computing = record.computing or self.step_started
            queued = max(0.0, computing - record.prompt_at)
            phases = record.carried | {
                Phase.PREFILL_QUEUE: queued,
                Phase.PREFILL_COMPUTE: max(0.0, now - computing),
            }
            record.prompt_at, record.decode_from, record.carried = None, now, {}
            return phases
        if record.decode_from is not None and index >= 1:
            phases = dict(record.carried)
            phases[Phase.FIRST_DECODE_STEP] = max(0.0, now - record.decode_from)
            record.decode_from = None
            return phases
        return None

    def _trace(self, record: DecodeRecord, out: RequestOutput) -> None:
        """Its span (tracing on): from the reservation (or the job run here) to its end."""
        if self.tracer.enabled and record.trace:
            attrs: dict[str, str | int | float | bool] = {
                "pdserve.request_id": record.request_id,
                "pdserve.choice": record.choice,
                "pdserve.worker": self.worker_id,
                "pdserve.output_tokens": out.num_output_tokens,
                "pdserve.finish_reason": str(out.finish_reason or ""),
            }
            self.tracer.span("decode", record.trace, record.reserved_at, time.monotonic(), attrs)
