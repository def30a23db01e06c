"""The in-process engine: ``add_request``, ``step``, ``abort``. No sockets (workers own those).

Every call to ``step`` schedules one batch (decode tokens and prefill chunks together), runs
the model once, samples, and returns what each touched request produced in that step.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.fork import ForkMixin
from pdserve.engine.grammar import GrammarCache
from pdserve.engine.kv_handoff import KVHandoffMixin
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.status import EngineStatusMixin
from pdserve.engine.step_budget import calibrate_step_budget
from pdserve.engine.tokenizer import Tokenizer
from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one request produced in one step (new tokens only) and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


class LLMEngine(KVHandoffMixin, ForkMixin, EngineStatusMixin):
    def __init__(self, config: EngineConfig) -> None:
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_model_len,
            self.model_config.max_model_len,
        )
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
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
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        self.eos_token_ids = _eos_ids(config.model, self.model_config)
        self._grammars: GrammarCache | None = None  # built on the first constrained request
        self.sampler = Sampler(self.runner.device, config.seed, self.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._final_outputs: list[Sequence] = []
        # disaggregation: KV kept past the end of a prefill-only request until it is sent,
        # and blocks reserved for KV that another worker will push here
        self.held: dict[str, Sequence] = {}
        self.reserved: dict[str, list[int]] = {}
        # tokens computed in prompt chunks (recomputation included), since start (metrics)
        self.prefill_tokens_computed = 0

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool = False,
    ) -> None:
        """Queue a request; ``ValueError`` for a duplicate id, bad tokens or a too-long one.

        ``hold_kv``: when it finishes, keep its blocks (``held_block_ids``) until ``release``;
        a prefill worker runs prompts this way, with ``max_tokens=1``, then pushes the KV.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        seq.hold_kv = hold_kv
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _new_sequence(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Sequence:
        if request_id in self.requests or request_id in self.held:
            raise ValueError(f"request id {request_id!r} is already running")
        self.check_prompt(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        if params.seed is not None:
            seq.generator = self.sampler.make_generator(params.seed)
        if params.structured is not None:
            seq.matcher = self.grammars.matcher(params.structured)
        return seq

    @property
    def grammars(self) -> GrammarCache:
        if self._grammars is None:
            tokenizer = Tokenizer.from_dir(self.config.model)
            self._grammars = GrammarCache(
                tokenizer.to_json(), self.model_config.vocab_size, self.eos_token_ids
            )
        return self._grammars

    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
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
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {total} tokens of KV cache, more than the "
                f"{self.block_manager.num_blocks * self.block_manager.block_size} this engine has"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks (held and reserved ones too); a running
        request's final output comes from the next step."""
        if self.release(request_id) or self.cancel_reservation(request_id):
            return True
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        if seq.choices is None:  # a prompt computed for n choices reports through them
            self._final_outputs.append(seq)
        self._abort_forked(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._final_outputs)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [self._output(seq) for seq in self._final_outputs]
        self._final_outputs.clear()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        inputs = self.runner.prepare(batch.seqs, batch.num_new_tokens)
        logits = self.runner.execute(inputs)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if not (n == 1 and seq.num_output_tokens and seq.num_uncomputed_tokens == 1):
                self.prefill_tokens_computed += n  # anything but one token's decode step
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        if inputs.sample_seqs:
            seqs, logits = self._fork_rows(inputs.sample_seqs, logits)
            sampled = self.sampler(logits, seqs)
            for seq, token, lp in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
                self._append_token(seq, token, lp)
                outputs.append(self._output(seq))
            self._settle_forks(inputs.sample_seqs)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            # cannot happen for a token sampled under the mask; never let it pass as "stop"
            logger.error("%s: constraint broken: %s", seq.request_id, seq.matcher.get_error())
            self.requests.pop(seq.request_id, None)
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"
            return
        self._check_finish(seq, token)

    def _check_finish(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif not p.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
        if seq.finish_reason is None and (
            seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.requests.pop(seq.request_id, None)
            self.scheduler.finish(seq, free=not seq.hold_kv)
            if seq.hold_kv:
                self.held[seq.request_id] = seq

    def _output(self, seq: Sequence) -> RequestOutput:
        start = seq.num_returned_tokens
        new_tokens = seq.token_ids[seq.num_prompt_tokens + start :]
        new_logprobs = seq.output_logprobs[start:] if seq.params.logprobs is not None else []
        seq.num_returned_tokens = seq.num_output_tokens
        return RequestOutput(
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

    # ---- convenience ------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion as one batch; one accumulated output per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{next(self._arrivals)}" for _ in prompts]
        results = {i: RequestOutput(i, []) for i in ids}
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            for out in self.step():
                acc = results[out.request_id]
                acc.new_token_ids += out.new_token_ids
                acc.new_logprobs += out.new_logprobs
                acc.finished, acc.finish_reason = out.finished, out.finish_reason
                acc.stop_reason = out.stop_reason
                acc.num_prompt_tokens, acc.num_cached_tokens = (
                    out.num_prompt_tokens,
                    out.num_cached_tokens,
                )
                acc.num_output_tokens = out.num_output_tokens
        return [results[i] for i in ids]


def _eos_ids(model_dir: str, cfg: ModelConfig) -> list[int]:
    """The tokenizer's eos ids (generation_config, tokenizer_config, config), else config's."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        return Tokenizer.from_dir(model_dir).eos_token_ids
    return list(cfg.eos_token_ids)
