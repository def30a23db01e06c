"""Owns the model, the paged KV cache and the attention backend; runs one step.

Input of a step: sequences with how many of their uncomputed tokens to run. Output: logits of
the last position of every sequence whose tokens are then all computed (the ones to sample).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, make_backend
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_rows: list[int]  # index into the token batch of each row to sample
    sample_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int):
        self.config = config
        self.device = torch.device(config.device)
        self.model = load_model(config.model, config.dtype, self.device, max_model_len)
        self.dtype = next(self.model.parameters()).dtype
        self.linear = self._pack_linears(config.cpu_linear)
        self.kv_cache = KVCache.create(model_config, config.cache, self.dtype, self.device)
        self.backend = make_backend(config.attention_backend, self.device)
        self.graphs = None  # CUDA only: captured decode steps (engine/cuda_graphs.py)
        if self.device.type == "cuda":
            from engine.cuda_graphs import maybe_capture

            self.graphs = maybe_capture(
                self.model, self.kv_cache.layers, self.backend, model_config, config, max_model_len
            )
        logger.info(
            "model %s (%s, %s) on %s; KV cache %d blocks x %d tokens (%.1f MiB), backend %s, "
            "linear %s",
            config.model,
            model_config.architecture,
            self.dtype,
            self.device,
            self.kv_cache.num_blocks,
            self.kv_cache.block_size,
            self.kv_cache.nbytes / 2**20,
            self.backend.name,
            self.linear,
        )

    def _pack_linears(self, choice: str) -> str:
        """oneDNN-packed linear layers on CPU (engine/cpu_linear.py), unless told otherwise."""
        if self.device.type != "cpu" or choice == "torch":
            return "torch"
        from engine.cpu_linear import onednn_status, pack_linears, packed_head

        usable, reason = onednn_status()
        if not usable:
            if choice == "onednn":
                raise RuntimeError(f"--cpu-linear onednn: {reason}")
            logger.info("linear layers through torch: %s", reason)
            return "torch"
        pack_linears(self.model)
        if self.model.lm_head is None:
            self.model.tied_head = packed_head(self.model.embed_tokens.weight)
        return "onednn"

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepInputs:
        bs = self.kv_cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(table)
            if end == seq.num_tokens:  # all tokens computed: the last one's logits are needed
                logits_rows.append(query_start[-1] - 1)
                sample_seqs.append(seq)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens_cpu=list(num_new_tokens),
            seq_lens_cpu=seq_lens,
            block_tables_cpu=[list(t) for t in tables],
            block_size=bs,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            metadata=metadata,
            logits_rows=logits_rows,
            sample_seqs=sample_seqs,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model over the step's tokens; logits [len(sample_seqs), V] float32."""
        if self.graphs is not None and self.graphs.can_run(inputs.metadata):
            hidden = self.graphs.run(inputs)
        else:
            self.backend.plan(inputs.metadata)
            layers = self.kv_cache.layers
            hidden = self.model(inputs.input_ids, inputs.positions, layers, self.backend)
        rows = torch.tensor(inputs.logits_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])
