"""The in-process engine: ``add_request``, ``step``, ``abort``, and what a worker reads of it
(``status``). No sockets (workers own those).

Every call to ``step`` schedules one batch (decode tokens and prefill chunks together), runs
the model once, samples, and returns what each touched request produced in that step.

The engine holds named parts, each owning one concern::

    requests   engine/requests.py    the table of sequences by id, making and ending them
    scheduler  engine/scheduler.py   the sequences' queues: waiting, running, waiting for
                                     remote KV
    forks      engine/fork.py        a prompt computed once for its n choices
    handoff    engine/kv_handoff.py  KV held for a transfer, reservations KV is written into
    status     EngineStatus, below   what a worker reads: blocks, KV layers, load

Workers register, heartbeat and move KV through ``status``, never through the scheduler or the
block manager, so either can change inside the engine without a worker noticing.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.block_manager import BlockManager, KVCache
from pdserve.engine.config import EngineConfig, ModelConfig, served_model_len
from pdserve.engine.fork import Forks
from pdserve.engine.kv_events import KVEventPublisher
from pdserve.engine.kv_handoff import KVHandoff
from pdserve.engine.model_runner import ModelRunner, StepInputs
from pdserve.engine.output_lengths import OutputLengths
from pdserve.engine.requests import RequestTable
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import RequestId, Scheduler, Sequence
from pdserve.engine.spec.speculator import Speculator
from pdserve.engine.spec.verify import verify
from pdserve.engine.step_budget import calibrate_step_budget
from pdserve.engine.step_target import StepTarget
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.control import SpecCounters, StepCounters
from pdserve.protocol.messages import FinishReason, TokenLogprob
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.tenancy import DEFAULT, Share

if TYPE_CHECKING:
    from pdserve.engine.tp.staging import KVStaging

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one request produced in one step (new tokens only) and whether it ended."""

    request_id: RequestId
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    # the prompt's logprobs (tokens 1..), once, on the output that follows its last chunk
    prompt_logprobs: list[TokenLogprob] | None = None


class LLMEngine:
    """One model, its KV cache and the requests on it; the work is in its parts."""

    def __init__(self, config: EngineConfig) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.max_model_len = served_model_len(config, self.model_config)
        group = None
        if config.tensor_parallel_size > 1:  # this process is rank 0 (engine/tp/)
            from pdserve.engine.tp.follower import pin
            from pdserve.engine.tp.launch import start_group
            from pdserve.engine.tp.layout import check_tp_size

            check_tp_size(self.model_config, config.tensor_parallel_size)
            group = start_group(config)
            pin(config, 0)  # after the others started: they chose their cores from all
        self.runner = ModelRunner(config, self.model_config, self.max_model_len, group)
        self.block_manager = BlockManager(
            self.runner.kv_cache.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
        )
        # the effective token budget (what fits max_step_time_s here) is the scheduler's:
        # self.scheduler.config.max_num_batched_tokens; config.scheduler keeps the flag's
        self.step_budget = calibrate_step_budget(
            self.runner, self.block_manager, config.scheduler, self.max_model_len
        )
        scheduler_config = config.scheduler
        if self.step_budget is not None:
            scheduler_config = replace(
                scheduler_config, max_num_batched_tokens=self.step_budget.tokens
            )
        # the TPOT target steps carrying decodes are sized by, and each step's figures
        self.steps = StepTarget.calibrate(
            config.scheduler, self.runner, self.block_manager, self.max_model_len, self.step_budget
        )
        self.scheduler = Scheduler(scheduler_config, self.block_manager, self.steps.cap())
        eos_token_ids = _eos_ids(config.model, self.model_config)
        self.sampler = Sampler(self.runner.device, config.seed, eos_token_ids)
        self.requests = RequestTable(
            config,
            self.model_config,
            self.max_model_len,
            eos_token_ids,
            self.scheduler,
            self.sampler,
        )
        kv_cache = self.runner.kv_cache
        self.forks = Forks(self.requests, self.scheduler, self.block_manager, kv_cache)
        staging = self.runner.staging_if_group
        self.handoff = KVHandoff(
            self.requests, self.scheduler, self.block_manager, kv_cache, staging
        )
        self.status = EngineStatus(
            self.block_manager, kv_cache, self.scheduler, self.requests.output_lengths, staging
        )
        self.spec = self._speculator(config) if config.speculative.enabled else None
        self._arrivals = itertools.count()
        # tokens computed in prompt chunks (recomputation included), since start (metrics)
        self.prefill_tokens_computed = 0
        self.recomputed_tokens = 0  # of those, tokens computed again after a preemption

    def _speculator(self, config: EngineConfig) -> Speculator:
        """The speculation part (engine/spec/), with its draft model in draft mode."""
        from pdserve.engine.spec.draft import DraftModel

        draft = None
        if config.speculative.mode == "draft":
            draft = DraftModel(config, self.runner, self.model_config, self.block_manager)
        return Speculator(
            config.speculative,
            self.block_manager,
            self.requests.max_seq_tokens,
            self.steps.model,
            draft,
        )

    def close(self) -> None:
        """Stop a tensor-parallel group's other ranks (also done at exit); nothing alone."""
        if self.runner.group is not None:
            self.runner.group.stop()

    def keep_alive(self) -> None:
        """Rank 0 of a tensor-parallel group: tell the other ranks it lives (an idle worker
        calls this each heartbeat period: a rank waits no longer than ``tp_timeout_s``)."""
        group = self.runner.group
        if group is not None and group.leads:
            from pdserve.engine.tp.group import Command

            with group.lock:
                group.command(Command.PING)

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool = False,
        share: Share = DEFAULT,
    ) -> None:
        """Queue a request; ``ValueError`` for a duplicate id, bad tokens or a too-long one.

        ``hold_kv``: when it finishes, keep its blocks (``handoff.held_block_ids``) until
        ``handoff.release``; a prefill worker runs prompts this way, with ``max_tokens=1``,
        then pushes the KV. ``share``: who it is for, the order it waits in.
        """
        seq = self.requests.new(request_id, prompt_token_ids, params)
        seq.hold_kv = hold_kv
        seq.share = share
        self.requests.admit(seq)

    def abort(self, request_id: RequestId) -> bool:
        """Stop a request and free whatever it holds: held KV, a reservation, or a live
        sequence's blocks (its final output comes from the next step)."""
        if self.handoff.release(request_id) or self.handoff.cancel_reservation(request_id):
            return True
        seq = self.requests.live.get(request_id)
        if seq is None:
            return False
        self.requests.end(seq)
        if seq.choices is None:  # a prompt computed for n choices reports through them
            self.requests.due.append(seq)
        for other in self.forks.dropped_with(seq):
            self.abort(other)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.requests.due)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._output(seq) for seq in self.requests.take_due()]
        start = time.perf_counter()
        spec = self.spec
        if spec is not None:
            spec.plan(self.scheduler)
        batch = self.scheduler.schedule()
        if not batch:
            if spec is not None:
                spec.end_step(None, [])
            return outputs
        decoding = [seq.is_decoding for seq in batch.seqs]
        if spec is not None:
            spec.fill(batch)
        inputs = self.runner.prepare(batch.seqs, batch.num_new_tokens)
        logits = self.runner.execute(inputs)
        if spec is not None and spec.draft is not None:  # its KV of the prompt chunks
            each = zip(batch.seqs, batch.num_new_tokens, decoding, strict=True)
            chunks = [(s, n) for s, n, d in each if not d]
            spec.draft.follow([s for s, _ in chunks], [n for _, n in chunks])
        for (seq, *_), scored in zip(inputs.scored, inputs.prompt_logprobs, strict=True):
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs += scored
        for seq, n, was_decode in zip(batch.seqs, batch.num_new_tokens, decoding, strict=True):
            if seq.spec_tokens:
                continue  # a verification: what it computed is what it keeps (spec.settle)
            if not (n == 1 and was_decode):
                self.prefill_tokens_computed += n  # anything but one token's decode step
            done = seq.num_computed_tokens
            self.recomputed_tokens += max(0, min(done + n, seq.recompute_until) - done)
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq, seq.draft_lag)
            if seq.params.max_tokens == 0 and seq.num_uncomputed_tokens == 0:
                self.requests.finish_scored(seq)  # its prompt scored, it ends with no token
                outputs.append(self._output(seq))
        if inputs.sample_seqs:
            plain, plain_logits, checks = split_rows(inputs, logits)
            if plain:
                seqs, rows = self.forks.rows(plain, plain_logits)
                sampled = self.sampler(rows, seqs)
                for seq, token, lp in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
                    self._append_token(seq, token, lp)
                    outputs.append(self._output(seq))
                self.forks.settle(plain)
            if checks and spec is not None:
                begun = time.perf_counter()
                verdicts = verify(checks, self.sampler, self._append_token)
                spec.settle(verdicts, time.perf_counter() - begun)
                outputs.extend(self._output(v.seq) for v in verdicts)
        seconds = time.perf_counter() - start
        if spec is not None:
            spec.end_step(batch, decoding)
            seconds -= spec.drafting_s  # priced apart (engine/spec/policy.py)
        self.steps.observe(batch, seconds)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            # cannot happen for a token sampled under the mask; never let it pass as STOP
            logger.error("%s: constraint broken: %s", seq.request_id, seq.matcher.get_error())
            self.requests.end(seq)
            return
        self.requests.check_finish(seq, token)

    def _output(self, seq: Sequence) -> RequestOutput:
        start = seq.num_returned_tokens
        new_tokens = seq.token_ids[seq.num_prompt_tokens + start :]
        new_logprobs = seq.output_logprobs[start:] if seq.params.logprobs is not None else []
        seq.num_returned_tokens = seq.num_output_tokens
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not seq.scoring_prompt and not seq.prompt_scored:
            prompt_logprobs, seq.prompt_scored = seq.prompt_logprobs, True
        return RequestOutput(
            prompt_logprobs=prompt_logprobs,
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
        )

    def step_counters(self) -> StepCounters:
        """The steps so far, with the TPOT target and step-time model sizing them (metrics)."""
        return self.steps.counters()

    def spec_counters(self) -> SpecCounters:
        """Speculative decoding so far (metrics); mode "off" without it."""
        return self.spec.counters() if self.spec is not None else SpecCounters()

    # ---- convenience ------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion as one batch; one accumulated output per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids: list[RequestId] = [f"gen-{next(self._arrivals)}" for _ in prompts]
        results = {i: RequestOutput(i, []) for i in ids}
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for out in self.step():
                acc = results[out.request_id]
                acc.new_token_ids += out.new_token_ids
                acc.new_logprobs += out.new_logprobs
                acc.prompt_logprobs = out.prompt_logprobs or acc.prompt_logprobs
                acc.finished, acc.finish_reason = out.finished, out.finish_reason
                acc.stop_reason = out.stop_reason
                acc.num_prompt_tokens, acc.num_cached_tokens = (
                    out.num_prompt_tokens,
                    out.num_cached_tokens,
                )
                acc.num_output_tokens = out.num_output_tokens
        return [results[i] for i in ids]


class EngineStatus:
    """The engine's status part: owns nothing, reads the block manager, the KV cache and the
    scheduler's queues for workers (registration, heartbeats, KV transfers)."""

    def __init__(
        self,
        blocks: BlockManager,
        kv_cache: KVCache,
        scheduler: Scheduler,
        lengths: OutputLengths,
        staging: Callable[[], KVStaging | None] = lambda: None,
    ) -> None:
        self._blocks = blocks
        self._kv_cache = kv_cache
        self._scheduler = scheduler
        self._lengths = lengths
        self._staging = staging

    # ---- the KV cache -----------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        """Tokens of KV one block holds."""
        return self._blocks.block_size

    @property
    def num_blocks(self) -> int:
        return self._blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self._blocks.num_used_blocks

    @property
    def kv_layers(self) -> list[torch.Tensor]:
        """The KV cache, one tensor a layer: what a KV sender reads and a receiver writes
        (a tensor-parallel group's rank 0: its staging blocks, every head whole)."""
        staging = self._staging()
        return self._kv_cache.all_layers if staging is None else staging.layers

    def kv_event_publisher(self, worker_id: str) -> KVEventPublisher:
        """The ``KVEvents`` of this engine's prefix cache (one publisher an engine: it hooks
        the block manager's store and evict events)."""
        return KVEventPublisher(self._blocks, worker_id)

    # ---- load -------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def queued_prompt_tokens(self) -> int:
        """Tokens still to compute, the load a placement weighs: every waiting sequence's, and
        each running one's but for a one-token decode step (cheap, and not prompt work)."""
        sched = self._scheduler
        waiting = sum(s.num_uncomputed_tokens for s in sched.waiting)
        return waiting + sum(s.num_uncomputed_tokens for s in sched.running if not s.is_decoding)

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (here or reserved into), since start."""
        return self._scheduler.prefix_hit_tokens

    # ---- growth: admission by need ------------------------------------------------------------
    @property
    def growth_blocks(self) -> int:
        """Blocks the running and waiting sequences are expected to take beyond those they
        hold, by the output lengths seen here (engine/output_lengths.py)."""
        sched = self._scheduler
        return self._lengths.growth_blocks([*sched.running, *sched.waiting])

    @property
    def expected_output_tokens(self) -> int:
        """Output tokens a new sequence is expected to produce here (0: none finished yet)."""
        return self._lengths.expected_output()

    @property
    def preemptions(self) -> int:
        """Sequences whose blocks were taken back to be recomputed, since start."""
        return self._scheduler.preemptions


def split_rows(
    inputs: StepInputs, logits: torch.Tensor
) -> tuple[list[Sequence], torch.Tensor, list[tuple[Sequence, torch.Tensor]]]:
    """A step's logits split into the sequences sampling one row (and their rows) and the
    verifications (each sequence with its ``1 + drafts`` rows: engine/spec/verify.py)."""
    counts = inputs.rows_per_seq
    if counts is None:
        return inputs.sample_seqs, logits, []
    plain: list[Sequence] = []
    plain_rows: list[int] = []
    checks: list[tuple[Sequence, torch.Tensor]] = []
    row = 0
    for seq, n in zip(inputs.sample_seqs, counts, strict=True):
        if n == 1:
            plain.append(seq)
            plain_rows.append(row)
        else:
            checks.append((seq, logits[row : row + n]))
        row += n
    return plain, logits[plain_rows], checks


def _eos_ids(model_dir: str, cfg: ModelConfig) -> list[int]:
    """The tokenizer's eos ids (generation_config, tokenizer_config, config), else config's."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        return Tokenizer.from_dir(model_dir).eos_token_ids
    return list(cfg.eos_token_ids)
