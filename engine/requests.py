"""The engine's request table: every sequence it holds by request id, how one is made and
when one ends.

    new / continued ─▶ admit ─▶ live ─stop, length─▶ (gone)    the scheduler runs what is live
                                  │    ─abort───────▶ due ─▶ its final output, next step
                                  └─ hold_kv ───────▶ held      KV kept until sent, then released

Reservations (sequences WAITING_FOR_REMOTE_KVS, engine/kv_handoff.py) are the scheduler's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.grammar import GrammarCache, advance
from pdserve.engine.output_lengths import OutputLengths
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import RequestId, Scheduler, Sequence, SequenceStatus
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.blocks import fork_blocks
from pdserve.protocol.messages import FinishReason
from pdserve.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)


class RequestTable(Mapping[RequestId, Sequence]):
    """Owns the engine's sequences by id: ``live`` (waiting, running, or a choice waiting for
    its token 0; what the mapping reads), ``held`` (finished, KV kept for a transfer) and ``due``
    (ended outside a step: their final outputs go out with the next one). Owns the checks a
    prompt must pass, making a sequence (seeded generator, output-constraint matcher), admitting
    it to the scheduler and the stop rules that end it."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        eos_token_ids: list[int],
        scheduler: Scheduler,
        sampler: Sampler,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler
        self.blocks: BlockManager = scheduler.blocks
        self.sampler = sampler
        self.live: dict[RequestId, Sequence] = {}
        self.held: dict[RequestId, Sequence] = {}
        self.due: list[Sequence] = []
        # the most tokens one sequence may have here: the context, or the whole cache
        cache_tokens = self.blocks.num_blocks * self.blocks.block_size
        self.max_seq_tokens = min(max_model_len, cache_tokens)
        self.output_lengths = OutputLengths(self.blocks.block_size, self.max_seq_tokens)
        self._grammars: GrammarCache | None = None  # built on the first constrained request

    # ---- the mapping: live sequences --------------------------------------------------------
    def __getitem__(self, request_id: RequestId) -> Sequence:
        return self.live[request_id]

    def __iter__(self) -> Iterator[RequestId]:
        return iter(self.live)

    def __len__(self) -> int:
        return len(self.live)

    # ---- making a sequence ------------------------------------------------------------------
    @property
    def grammars(self) -> GrammarCache:
        if self._grammars is None:
            tokenizer = Tokenizer.from_dir(self.config.model)
            self._grammars = GrammarCache(
                tokenizer.to_json(), self.model_config.vocab_size, self.eos_token_ids
            )
        return self._grammars

    def check_prompt(
        self, prompt_token_ids: list[int], params: SamplingParams, choices: int = 1
    ) -> None:
        """``ValueError`` for an empty prompt, tokens outside the vocabulary, a request longer
        than the context, or a prompt whose KV (with token 0's slot for each of ``choices``)
        alone exceeds the whole KV cache. ``max_tokens`` books no memory: a sequence grows as
        it decodes (and ends at the cache's size, ``max_seq_tokens``)."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the model's context length of {self.max_model_len} tokens"
            )
        params.check_prompt_logprobs(len(prompt_token_ids))
        if params.prompt_logprobs is not None and choices > 1:
            raise ValueError("prompt logprobs (echo, prompt_logprobs) are for one choice (n=1)")
        num_blocks, block_size = self.blocks.num_blocks, self.blocks.block_size
        need = fork_blocks(len(prompt_token_ids), choices, block_size)
        if need > num_blocks:
            raise ValueError(
                f"the prompt ({len(prompt_token_ids)} tokens, {choices} choice(s)) needs "
                f"{need * block_size} tokens of KV cache, more than the "
                f"{num_blocks * block_size} this worker holds"
            )

    def new(
        self, request_id: RequestId, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        """A sequence for a checked prompt; ``ValueError`` if the id is live or held."""
        if request_id in self.live or request_id in self.held:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_prompt(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = []
        if params.seed is not None:
            seq.generator = self.sampler.make_generator(params.seed)
        if params.structured is not None:
            seq.matcher = self.grammars.matcher(params.structured)
        return seq

    def continued(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        generated: list[int],
        params: SamplingParams,
    ) -> Sequence:
        """A sequence whose first ``generated`` tokens were drawn elsewhere: its outputs start
        after them, its constraint and seeded generator where they left them."""
        if not generated:
            raise ValueError("a continued request needs at least one generated token")
        seq = self.new(request_id, prompt_token_ids, params)
        seq.prompt_logprobs = None  # scored, if asked, where its first tokens were drawn
        seq.token_ids.extend(generated)
        seq.num_returned_tokens = len(generated)
        if seq.matcher is not None:
            advance(seq.matcher, generated)  # the constraint resumes where they left it
        if seq.generator is not None and not params.greedy:
            # each earlier token drew once from this seed elsewhere; stay in step with it
            for _ in generated:
                self.sampler.skip_draw(seq.generator, self.model_config.vocab_size)
        return seq

    # ---- admitting and ending ---------------------------------------------------------------
    def admit(self, seq: Sequence, front: bool = False) -> None:
        """``seq`` goes live and waits in the scheduler (``front``: ahead of every other)."""
        self.live[seq.request_id] = seq
        self.scheduler.add(seq, front=front)

    def admit_continued(self, seq: Sequence) -> None:
        """As ``admit``; a sequence its tokens so far end already reports so next step."""
        self.admit(seq)
        self.check_finish(seq, seq.last_token_id)
        if seq.status is SequenceStatus.FINISHED:
            self.due.append(seq)  # reported, with its finish reason, next step

    def check_finish(self, seq: Sequence, token: int) -> None:
        """End ``seq`` after ``token`` if it is a stop token (past ``min_tokens``) or the
        length is reached; a ``hold_kv`` sequence keeps its blocks, ``held``."""
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
            elif not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = FinishReason.STOP
        if seq.finish_reason is None and (
            seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_seq_tokens
        ):
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            self._finished(seq)

    def finish_scored(self, seq: Sequence) -> None:
        """End a ``max_tokens`` 0 sequence whose prompt is computed (and scored): no token."""
        seq.finish_reason = FinishReason.LENGTH
        self._finished(seq)

    def _finished(self, seq: Sequence) -> None:
        """Out of the table and the scheduler; a ``hold_kv`` sequence keeps its blocks."""
        if not seq.hold_kv:  # a prefill worker's token 0 says nothing of output lengths
            self.output_lengths.finished(seq.num_output_tokens)
        self.live.pop(seq.request_id, None)
        self.scheduler.finish(seq, free=not seq.hold_kv)
        if seq.hold_kv:
            self.held[seq.request_id] = seq

    def end(self, seq: Sequence) -> None:
        """Abort a live sequence: out of the table and the scheduler, blocks freed."""
        self.live.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        seq.finish_reason = FinishReason.ABORT

    def take_due(self) -> list[Sequence]:
        due, self.due = self.due, []
        return due
