"""A draft model: a small model sharing the target's tokenizer proposes ``k`` tokens greedily,
one pass a token, for every speculating sequence at once.

Its KV lives in the target's blocks (``KVCache.draft_layers``: the same block ids, its own
layers), so block tables, forks, preemption, the prefix cache and KV transfers serve both::

    block b:  target layers 0..L-1 | draft layers 0..L'-1     one id, moved and copied whole

It computes every prompt chunk the target computes, in the same step (``follow``): a prefill
worker's transfer carries the draft's prompt KV with the target's, and a decode worker computes
no draft prompt token. In decode steps it lags: a sequence's ``draft_lag`` trailing tokens have
the target's KV but not yet the draft's (a step it did not draft for, or all ``k`` drafts kept);
its next proposal computes them first. A block enters the prefix cache only once both models'
KV is in it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from pdserve.engine.model_runner import ModelRunner, StepInputs
from pdserve.engine.scheduler import Sequence
from pdserve.engine.step_model import calibrate_step_model

logger = logging.getLogger(__name__)


class DraftModel:
    """Owns the draft model's runner (its weights, attention backend, step buffers; its KV
    layers are the target cache's ``draft_layers``) and what drafting has cost."""

    def __init__(
        self,
        config: EngineConfig,
        target: ModelRunner,
        target_config: ModelConfig,
        blocks: BlockManager,
    ) -> None:
        spec = config.speculative
        if spec.draft_model is None:
            raise ConfigError("--speculative draft needs --draft-model")
        draft_dir = spec.draft_model
        draft_config = ModelConfig.from_dir(draft_dir)
        problem = pairing_problem(config.model, draft_dir, target_config, draft_config)
        if problem is not None:
            raise ConfigError(f"--draft-model {draft_dir}: {problem}")
        cache = replace(config.cache, num_blocks=target.kv_cache.num_blocks)
        own = replace(
            config,
            model=draft_dir,
            quantization=spec.draft_quantization,
            compile=False,
            cache=cache,
            speculative=SpeculativeConfig(),
        )
        self.runner = ModelRunner(own, draft_config, target.max_model_len)
        if self.runner.dtype != target.dtype:
            raise ConfigError(
                f"--draft-model {draft_dir}: its KV would be {self.runner.dtype}, the target's "
                f"is {target.dtype} (pass --dtype)"
            )
        target.kv_cache.draft_layers = self.runner.kv_cache.layers
        self.name = Path(draft_dir).name
        self.num_layers = draft_config.num_layers
        self.weights = self.runner.model.quantization
        # what one drafting pass costs here, by sequences (and tokens caught up): its own
        # step-time model, probed now and refit from every pass (engine/step_model.py)
        self.model = calibrate_step_model(
            self.runner, blocks, target.max_model_len, config.scheduler.max_num_seqs
        )
        self.tokens = 0  # tokens it computed
        self.prompt_tokens = 0  # of those, prompt tokens (0 on a decode worker fed by transfers)

    def describe(self) -> str:
        """What ``KVLayout.draft`` says of it: another worker's must say the same to pair."""
        return f"{self.name} {self.num_layers} layers {self.weights}"

    # ---- prompt work, beside the target ---------------------------------------------------------
    def follow(self, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
        """Compute the prompt chunks the target computes this step (called before the step
        counts them computed): the draft's KV stays in step with the target's."""
        if not seqs:
            return
        inputs = self.runner.prepare(seqs, num_new_tokens)
        self.runner.execute(inputs)
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            self.tokens += n
            self.prompt_tokens += max(0, min(start + n, seq.num_prompt_tokens) - start)

    # ---- drafting ------------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], counts: list[int]) -> tuple[list[list[int]], float]:
        """``counts[i]`` greedy drafts for ``seqs[i]`` (whose blocks hold ``counts[i]`` slots
        past its last token), and the seconds it took. The first pass also computes what the
        draft lags behind; each sequence's ``draft_lag`` is then 0 (``settle`` sets it after
        the verification)."""
        start = time.perf_counter()
        first = [(seq.num_computed_tokens - seq.draft_lag, seq.num_tokens) for seq in seqs]
        tokens = [seq.token_ids[a:b] for seq, (a, b) in zip(seqs, first, strict=True)]
        logits = self._run(seqs, tokens, [a for a, _ in first])
        caught_up = sum(len(t) - 1 for t in tokens)  # past each one's last token: prompt-like
        self.model.observe(caught_up, len(seqs), time.perf_counter() - start)
        for seq, (a, _) in zip(seqs, first, strict=True):
            self.prompt_tokens += max(0, seq.num_prompt_tokens - a)
            seq.draft_lag = 0
        drafts = [[t] for t in logits.argmax(dim=-1).tolist()]
        for j in range(1, max(counts)):
            active = [i for i, c in enumerate(counts) if c > j]
            positions = [seqs[i].num_tokens - 1 + j for i in active]
            begun = time.perf_counter()
            logits = self._run(
                [seqs[i] for i in active], [[drafts[i][-1]] for i in active], positions
            )
            self.model.observe(0, len(active), time.perf_counter() - begun)
            for i, t in zip(active, logits.argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(t)
        return drafts, time.perf_counter() - start

    def seconds(self, seqs: int, passes: int) -> float:
        """What drafting ``passes`` tokens for ``seqs`` sequences is predicted to take."""
        return passes * self.model.costs.seconds(0, seqs)

    def _run(
        self, seqs: list[Sequence], tokens: list[list[int]], starts: list[int]
    ) -> torch.Tensor:
        """One pass: ``tokens[i]`` at positions ``starts[i]..``; the logits of each last one."""
        bs = self.runner.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        for seq, toks, a in zip(seqs, tokens, starts, strict=True):
            table = seq.block_table
            ids.extend(toks)
            positions.extend(range(a, a + len(toks)))
            slots.extend(table[p // bs] * bs + p % bs for p in range(a, a + len(toks)))
            rows.append(len(ids) - 1)
            self.tokens += len(toks)
        ids_t, pos_t, slot_t, rows_t = self.runner.buffers.load(ids, positions, slots, rows)
        metadata = AttentionMetadata(
            slot_mapping=slot_t,
            query_lens_cpu=[len(t) for t in tokens],
            seq_lens_cpu=[a + len(t) for a, t in zip(starts, tokens, strict=True)],
            block_tables_cpu=[seq.block_table for seq in seqs],
            block_size=bs,
        )
        return self.runner.execute(StepInputs(ids_t, pos_t, metadata, rows, [], rows_t))


def pairing_problem(
    target_dir: str, draft_dir: str, target: ModelConfig, draft: ModelConfig
) -> str | None:
    """Why ``draft`` cannot draft for ``target``, or None: the same tokenizer (vocabulary and
    special tokens), and KV blocks of the same shape (its layers travel in the target's
    transfers, which move blocks of one shape)."""
    if draft.vocab_size != target.vocab_size:
        return f"a vocabulary of {draft.vocab_size} tokens, the target's has {target.vocab_size}"
    a, b = Path(target_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json"
    if not (a.is_file() and b.is_file()):
        return "no tokenizer.json beside both models to compare"
    from tokenizers import Tokenizer as HFTokenizer

    if HFTokenizer.from_file(str(a)).get_vocab(True) != HFTokenizer.from_file(str(b)).get_vocab(
        True
    ):
        return "its tokenizer is not the target's (different tokens or ids)"
    if (draft.num_kv_heads, draft.head_dim) != (target.num_kv_heads, target.head_dim):
        return (
            f"its KV heads x head size are {draft.num_kv_heads} x {draft.head_dim}, the "
            f"target's {target.num_kv_heads} x {target.head_dim}: a draft's KV must have the "
            "target's block shape to travel in its transfers"
        )
    return None
