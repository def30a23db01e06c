"""Decode worker: takes over requests whose prompt KV another worker pushed into its blocks.

Lifecycle of one choice (``key = request_id#choice``), each in exactly one dict::

    Reserve ──▶ reserved ──TransferDone──▶ receiving ──receiver DONE──▶ running ──▶ (gone)
                   │                           │                          │ finished, aborted:
                   │ Abort                     │ FAILED, timeout, Abort   │ engine frees blocks
                   ▼                           ▼                          ▼
              blocks freed               blocks freed, error to gateway  Finished to coordinator

A worker of role ``both`` (colocated mode) also takes a ``PrefillJob`` with no destination
blocks: it runs the whole request in its own engine, token 0 included.
``DecodeWorker`` has no sockets: ``handle`` takes a message, ``step`` runs one engine step,
and everything it says goes through an ``Outbox``.
"""

from __future__ import annotations

import logging
import time

from pdserve.decode.choice import Choice
from pdserve.engine.block_manager import NoFreeBlocks
from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.kvtransfer.base import KVPoll, KVReceiver
from pdserve.protocol import messages as m
from pdserve.worker.wire import (
    Outbox,
    TokenBatcher,
    choice_params,
    engine_key,
    prompt_key,
)

logger = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(
        self,
        engine: LLMEngine,
        receiver: KVReceiver | None,
        worker_id: str,
        outbox: Outbox,
        transfer_timeout_s: float = 30.0,
        kv_failure_policy: str = "recompute",
    ) -> None:
        if kv_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"kv_failure_policy must be recompute or fail, not {kv_failure_policy!r}"
            )
        self.kv_failure_policy = kv_failure_policy
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.outbox = outbox
        self.tokens = TokenBatcher(outbox)  # this step's chunks, one message per gateway
        self.draining = False
        self.transfer_timeout_s = transfer_timeout_s
        self.reserved: dict[str, Choice] = {}
        self.receiving: dict[str, Choice] = {}
        self.running: dict[str, Choice] = {}

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
            self.outbox.to_coordinator(self._reserved(msg, [], "worker is draining"))
            return
        key = engine_key(msg.request_id, msg.choice)
        choice = Choice.of(msg)
        try:
            self.engine.check_prompt(msg.prompt_token_ids, msg.sampling)
            # leading blocks this worker's prefix cache holds are shared, not moved again
            ids, cached = self.engine.reserve_prompt(key, msg.prompt_token_ids, choice.choices)
        except (ValueError, NoFreeBlocks) as e:
            self.outbox.to_coordinator(self._reserved(msg, [], str(e)))
            return
        choice.num_local_cached_tokens = cached * self.engine.block_size
        secret = b""  # the sender must present it (kvtransfer.base.KVReceiver.expect)
        if self.receiver is not None:
            # the KV of the prompt fills the leading blocks; the last one is for token 0 on
            prompt_blocks = self.engine.blocks_needed(len(msg.prompt_token_ids))
            secret = self.receiver.expect(key, ids[cached:prompt_blocks], self.transfer_timeout_s)
        self.reserved[key] = choice
        self.outbox.to_coordinator(self._reserved(msg, ids, None, secret, cached))

    def _reserved(
        self,
        msg: m.Reserve,
        ids: list[int],
        error: str | None,
        secret: bytes = b"",
        cached_blocks: int = 0,
    ) -> m.Reserved:
        address = self.receiver.address if self.receiver is not None else ""
        free = self.engine.num_free_blocks  # the coordinator's estimate follows it
        return m.Reserved(
            msg.request_id,
            self.worker_id,
            ids,
            address,
            error,
            msg.choice,
            free,
            secret,
            cached_blocks,
        )

    def _transfer_done(self, msg: m.TransferDone) -> None:
        key = engine_key(msg.request_id, msg.choice)
        choice = self.reserved.pop(key, None)
        if choice is None:
            logger.warning("transfer done for unknown request %s", key)
            return
        choice.first_tokens = list(msg.first_token_ids)
        choice.first_logprobs = msg.first_logprobs
        choice.num_cached_tokens = msg.num_cached_tokens
        choice.dropped.update(msg.ended)
        lps = choice.first_logprobs
        if len(choice.first_tokens) != choice.choices or (lps and len(lps) != choice.choices):
            self._drop_pending(key)
            self._fail(choice, 500, f"token 0 of {choice.choices} choices expected, not so many")
            return
        if msg.error is not None:
            if self.receiver is not None:
                self.receiver.release(key)
            self._on_transfer_failed(key, choice, msg.error)
            return
        self.receiving[key] = choice

    def _run_locally(self, msg: m.PrefillJob) -> None:
        """No transfer: the prompt runs here, once for all its choices, each forked from it
        (engine/fork.py); or one choice continues after the tokens it streamed elsewhere."""
        choice = Choice.of(msg)
        if self.draining:
            self._fail(choice, 503, "worker is draining")
            return
        keys = {c: engine_key(msg.request_id, c) for c in choice.going()}
        params = [choice_params(msg.sampling, c) for c in keys]
        try:
            if msg.generated_token_ids:  # a stream moving here from a dead worker
                self.engine.add_continuation(
                    keys[msg.choice], msg.prompt_token_ids, msg.generated_token_ids, params[0]
                )
            elif len(keys) == 1:
                self.engine.add_request(keys[msg.choice], msg.prompt_token_ids, params[0])
            else:
                prompt_id = prompt_key(msg.request_id, msg.choice)
                ids = list(keys.values())
                self.engine.add_request_n(prompt_id, ids, msg.prompt_token_ids, params)
        except ValueError as e:
            self._fail(choice, 400, str(e))
            return
        for c, key in keys.items():
            self.running[key] = choice.one(c)

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """One choice (or every one) of the request, whatever its state; blocks freed now.
        A choice that shares a reservation it does not lead is only kept from decoding."""
        for table in (self.reserved, self.receiving):
            for key, c in list(table.items()):
                if c.request_id != request_id:
                    continue
                if choice is not None and choice != c.choice and choice in c.going():
                    c.dropped.add(choice)
                if choice in (None, c.choice) or not c.going():
                    self._drop_pending(key)
        for key in [k for k, c in self.running.items() if c.matches(request_id, choice)]:
            del self.running[key]
            self.engine.abort(key)

    def _drop_pending(self, key: str) -> None:
        """A reservation, with whatever is arriving into it, given up: blocks freed now."""
        self.reserved.pop(key, None)
        self.receiving.pop(key, None)
        self.engine.abort(key)
        if self.receiver is not None:
            self.receiver.release(key)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit choices whose KV has landed, run one engine step, stream what it produced.
        Returns whether there was anything to do."""
        self._admit_received()
        if not self.engine.has_unfinished():
            return bool(self.receiving)
        for out in self.engine.step():
            self._emit(out)
        self.tokens.flush()
        return True

    def _admit_received(self) -> None:
        self._expire_reservations()
        for key, choice in list(self.receiving.items()):
            state = self.receiver.poll(key) if self.receiver is not None else KVPoll.DONE
            if state is KVPoll.FAILED:
                reason = self.receiver.failure_reason(key) if self.receiver else None
                del self.receiving[key]
                self.receiver.release(key)
                self._on_transfer_failed(key, choice, reason)
            elif state is KVPoll.DONE:
                del self.receiving[key]
                if self.receiver is not None:
                    self.receiver.release(key)
                self._start_decoding(key, choice)

    def _start_decoding(self, key: str, choice: Choice) -> None:
        """The prompt's KV is here: each choice still wanted decodes after its token 0."""
        going = choice.going()
        if not going:
            self.engine.abort(key)
            return
        at = [c - choice.choice for c in going]
        lps = choice.first_logprobs
        tokens = [choice.first_tokens[i] for i in at]
        first_lps = [lps[i] if lps else None for i in at]
        params = [choice_params(choice.sampling, c) for c in going]
        keys = [engine_key(choice.request_id, c) for c in going]
        prompt = choice.prompt_token_ids
        cached = max(choice.num_cached_tokens, choice.num_local_cached_tokens)
        try:
            if going == [choice.choice] and choice.choices == 1:
                self.engine.add_prefilled(
                    key, prompt, tokens[0], params[0], first_lps[0], num_cached_tokens=cached
                )
            else:
                self.engine.add_prefilled_n(
                    key, keys, prompt, tokens, params, first_lps, num_cached_tokens=cached
                )
        except ValueError as e:  # the reservation is freed
            self._fail(choice, 500, f"could not start decoding: {e}")
            return
        for c, k in zip(going, keys, strict=True):
            self.running[k] = choice.one(c)

    def _expire_reservations(self) -> None:
        """A reservation nobody followed up (its prefill worker and the coordinator both gone):
        the coordinator normally sends TransferDone or Abort well within this time."""
        now = time.monotonic()
        for key, choice in list(self.reserved.items()):
            if now - choice.reserved_at > 3 * self.transfer_timeout_s:
                del self.reserved[key]
                if self.receiver is not None:
                    self.receiver.release(key)
                self.engine.abort(key)
                self._fail(choice, 503, "the prompt's KV never arrived")

    def _on_transfer_failed(self, key: str, choice: Choice, reason: str | None) -> None:
        """``recompute``: prefill the prompt (and token 0) here instead; ``fail``: end it."""
        if self.kv_failure_policy == "recompute":
            logger.warning("KV transfer for %s failed (%s): recomputing locally", key, reason)
            self.engine.cancel_reservation(key)
            for c in choice.going():
                k = engine_key(choice.request_id, c)
                try:
                    params = choice_params(choice.sampling, c)
                    token = choice.first_tokens[c - choice.choice]
                    self.engine.add_continuation(k, choice.prompt_token_ids, [token], params)
                except ValueError as e:
                    self.abort(choice.request_id)
                    message = f"KV transfer failed ({reason}); recompute failed: {e}"
                    self._fail(choice, 500, message)
                    return
                self.running[k] = choice.one(c)
            return
        self.engine.abort(key)
        self._fail(choice, 500, f"KV transfer failed: {reason}")

    def _emit(self, out: RequestOutput) -> None:
        choice = self.running.get(out.request_id)
        if choice is None:
            return
        if out.finished:
            del self.running[out.request_id]
            self.outbox.to_coordinator(m.Finished(choice.request_id, choice.choice, self.worker_id))
            if out.finish_reason == "abort":
                return
        self.tokens.add(
            choice.stream_address,
            m.TokenChunk(
                request_id=choice.request_id,
                choice=choice.choice,
                index=out.num_output_tokens - len(out.new_token_ids),
                token_ids=out.new_token_ids,
                logprobs=out.new_logprobs or None,
                finished=out.finished,
                finish_reason=out.finish_reason,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
            ),
        )

    def _fail(self, choice: Choice, status: int, message: str) -> None:
        logger.warning("request %s#%d failed: %s", choice.request_id, choice.choice, message)
        error = m.RequestError(choice.request_id, status, message)
        self.tokens.flush()
        self.outbox.to_gateway(choice.stream_address, error)
        self.outbox.to_coordinator(error)

    def begin_drain(self) -> None:
        """Finish what is here; new work is turned away (the coordinator stops sending it)."""
        self.draining = True

    def in_flight(self) -> bool:
        return bool(self.reserved or self.receiving or self.running)

    @property
    def queued_prompt_tokens(self) -> int:
        return self.engine.queued_prompt_tokens
