"""Owns the model, the paged KV cache and the attention backend; runs one step.

Input of a step: sequences with how many of their uncomputed tokens to run. Output: logits of
the last position of every sequence whose tokens are then all computed (the ones to sample).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.attention import AttentionMetadata, make_backend
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.block_manager import KVCache
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cpu_layers import NativeLayers
from pdserve.engine.loader import load_model
from pdserve.engine.quant.activations import set_activations
from pdserve.engine.sampler import token_logprobs
from pdserve.engine.scheduler import Sequence
from pdserve.protocol.messages import TokenLogprob

if TYPE_CHECKING:  # imported when used: --compile, CUDA and tensor parallelism only
    from pdserve.engine.compile import CompiledDecode
    from pdserve.engine.cuda_graphs import CudaGraphRunner
    from pdserve.engine.tp.group import TPGroup
    from pdserve.engine.tp.staging import KVStaging

logger = logging.getLogger(__name__)

SCORE_ROWS = 256  # prompt positions scored at once: [256, V] float32 logits


@dataclass
class StepInputs:
    """One step's inputs; the tensors are views of ``StepBuffers``, valid until the next
    ``prepare``."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_rows: list[int]  # index into the token batch of each row to sample
    sample_seqs: list[Sequence]
    logits_index: torch.Tensor  # [len(logits_rows)]: logits_rows on the device
    # rows of logits each of sample_seqs has, in order: 1, or 1 + its drafts (a verification
    # reads every position: engine/spec/verify.py); empty: one each
    rows_per_seq: list[int] | None = None
    # prompt positions scored this step (``Sequence.prompt_logprobs``): (sequence, its first
    # row in the token batch, that row's position, rows); a row scores the token after it
    scored: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    # ``execute`` fills it: each scored entry's logprobs, in order
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)


class StepBuffers:
    """Step inputs live in tensors kept across steps: each step writes its ids, positions,
    slots and logits rows into one int64 host tensor (through a numpy view, no tensor built
    per list) and hands out views of it; a GPU runner copies it over in one transfer::

            host (pinned on CUDA)  [ ids: T | positions: T | slots: T | logits rows: N ]
                                    └─ one copy_ ─▶ the same layout on the device

    Grown (doubled) when a step needs more room."""

    def __init__(self, device: torch.device, capacity: int = 1024) -> None:
        self.device = device
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self.capacity = capacity
        pin = self.device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.long, pin_memory=pin)
        self.host_np = self.host.numpy()
        self.dev = self.host if self.device.type == "cpu" else self.host.to(self.device)

    def load(
        self, ids: list[int], positions: list[int], slots: list[int], rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        t, n = len(ids), len(rows)
        end = 3 * t + n
        if end > self.capacity:
            self._grow(max(2 * self.capacity, end))
        host = self.host_np
        host[:t] = ids
        host[t : 2 * t] = positions
        host[2 * t : 3 * t] = slots
        host[3 * t : end] = rows
        if self.dev is not self.host:
            # blocking: the next step rewrites the host tensor
            self.dev[:end].copy_(self.host[:end])
        return self._views(t, n)

    def load_packed(
        self, packed: torch.Tensor, t: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``load`` from the four parts already packed as ``host`` holds them (a step
        another rank prepared: engine/tp/commands.py)."""
        if packed.numel() > self.capacity:
            self._grow(max(2 * self.capacity, packed.numel()))
        self.host[: packed.numel()].copy_(packed)
        if self.dev is not self.host:
            self.dev[: packed.numel()].copy_(self.host[: packed.numel()])
        return self._views(t, n)

    def _views(
        self, t: int, n: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.dev
        return d[:t], d[t : 2 * t], d[2 * t : 3 * t], d[3 * t : 3 * t + n]


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold as served: float parameters, oneDNN-packed copies and
    quantized layers (codes, scales, mins, biases)."""
    from pdserve.engine.cpu_linear import PackedLinear
    from pdserve.engine.quant.linear import QuantLinear

    total = sum(p.nbytes for p in model.parameters())
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.weight_bytes
        elif isinstance(module, PackedLinear) and isinstance(module.packed, torch.Tensor):
            total += module.packed.nbytes
    return total


class ModelRunner:
    """``group``: this process is a rank of a tensor-parallel group (engine/tp/): it holds its
    part of the model and its heads of every KV block; rank 0 sends each step to the others."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        group: TPGroup | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.device = torch.device(config.device)
        self.group = group
        layout = None
        if group is not None:
            from pdserve.engine.tp.layout import TPLayout

            layout = TPLayout(model_config, group.rank, group.size)
        self.layout = layout
        self.model = load_model(
            config.model,
            config.dtype,
            self.device,
            max_model_len,
            quantization=config.quantization,
            group_size=config.quant_group_size,
            layout=layout,
        )
        self.dtype = next(self.model.parameters()).dtype
        self.linear = self._pack_linears(config.cpu_linear)
        acts = set_activations(self.model, config.quant_activations)
        if acts:
            self.linear += f", quantized layers on {acts} activations"
        if group is not None and layout is not None:
            from pdserve.engine.tp.runner import group_cache, wire_model

            wire_model(self.model, group, layout)
            self.kv_cache = group_cache(group, layout, config.cache, self.dtype, self.device)
        else:
            draft = _draft_config(config)
            self.kv_cache = KVCache.create(
                model_config, config.cache, self.dtype, self.device, draft=draft
            )
        self._staging: KVStaging | None = None
        self.backend = make_backend(config.attention_backend, self.device)
        self.buffers = StepBuffers(self.device)
        # CPU, --compile: decode steps through torch.compile
        self.compiled: CompiledDecode | None = None
        if config.compile:
            self._compile_decode()
        # CPU, decode steps: the layers in one C call where the model and kernels allow
        self.native: NativeLayers | None = None
        if self.device.type == "cpu" and group is None and not config.compile:
            self.native = NativeLayers.build(self.model, self.kv_cache.layers)
        # CUDA only: captured decode steps (engine/cuda_graphs.py)
        self.graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda" and group is None:
            from pdserve.engine.cuda_graphs import maybe_capture

            self.graphs = maybe_capture(
                self.model, self.kv_cache.layers, self.backend, model_config, config, max_model_len
            )
        kv_tokens = self.kv_cache.num_blocks * self.kv_cache.block_size
        logger.info(
            "model %s (%s, %s, weights %s: %.1f MiB) on %s; KV cache (%s) %d blocks x %d tokens "
            "= %d tokens (%.1f MiB, %s: %.1f sequences of the full %d-token context), "
            "backend %s, linear %s%s",
            config.model,
            model_config.architecture,
            self.dtype,
            self.model.quantization,
            weight_bytes(self.model) / 2**20,
            self.device,
            str(self.kv_cache.layers[0].dtype).removeprefix("torch."),
            self.kv_cache.num_blocks,
            self.kv_cache.block_size,
            kv_tokens,
            self.kv_cache.nbytes / 2**20,
            KVCache.sized_by(config.cache, self.device),
            kv_tokens / max_model_len,
            max_model_len,
            self.backend.name,
            self.linear,
            "" if layout is None else f", tensor-parallel rank {layout.rank} of {layout.size}",
        )

    def kernel_threads(self, threads: Callable[[int], int]) -> None:
        """The quantized layers ask ``threads(rows)`` how many threads to use before each call
        (engine/core_board.py: the cores other workers leave idle); their results do not
        depend on it."""
        from pdserve.engine.quant.linear import QuantLinear

        for module in self.model.modules():
            if isinstance(module, QuantLinear):
                module.threads = threads

    def staging_if_group(self) -> KVStaging | None:
        """``staging``, as a callable (what the engine's parts hold)."""
        return self.staging

    @property
    def staging(self) -> KVStaging | None:
        """Rank 0 of a group: its full-head blocks for KV transfers (made on first use, so a
        worker that moves no KV holds none); None alone or past rank 0."""
        if self.group is None or not self.group.leads or self.layout is None:
            return None
        if self._staging is None:
            from pdserve.engine.tp.runner import make_staging

            self._staging = make_staging(self)
        return self._staging

    def _pack_linears(self, choice: str) -> str:
        """oneDNN-packed linear layers on CPU (engine/cpu_linear.py), unless told otherwise."""
        if self.device.type != "cpu" or choice == "torch":
            return "torch"
        from pdserve.engine.cpu_linear import pack_linears, packed_head, use_onednn

        if not use_onednn(choice, self.dtype, "--cpu-linear", "linear layers"):
            return "torch"
        packed = pack_linears(self.model)  # the float ones: quantized layers stay as they are
        if self.model.lm_head is None and self.model.tied_head is None:
            self.model.tied_head = packed_head(self.model.head_weight())
            packed += self.model.tied_head is not None
        return "onednn" if packed else "quantized"

    def _compile_decode(self) -> None:
        """Build the compiled decode graphs now, through ``execute``: one for batch 1, one for
        every larger batch (dynamic shapes). The dummy steps write block 0, free at start."""
        from pdserve.engine.compile import CompiledDecode

        compiled = self.compiled = CompiledDecode(self.model, self.kv_cache.layers)
        start = time.perf_counter()
        for batch in (1, 2):
            ids, pos, slots, _ = self.buffers.load([0] * batch, [0] * batch, [0] * batch, [])
            bs = self.kv_cache.block_size
            with torch.inference_mode():  # as in execute: the plan's tensors are made there
                self.backend.plan(
                    AttentionMetadata(slots, [1] * batch, [1] * batch, [[0]] * batch, bs)
                )
                if compiled.run(ids, pos, self.backend) is None:
                    raise RuntimeError(f"{self.backend.name} backend gave no step to compile")
        seconds = time.perf_counter() - start
        logger.info("torch.compile: decode graphs (batch 1, batch 2+) built in %.0f s", seconds)

    def prepare(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepInputs:
        bs = self.kv_cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        rows_per_seq: list[int] = []
        scored: list[tuple[Sequence, int, int, int]] = []
        num_tokens = 0
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            if seq.scoring_prompt and seq.prompt_logprobs is not None:
                # position p scores prompt token p + 1; those scored before are not again
                first = max(start, len(seq.prompt_logprobs))
                last = min(end, seq.num_prompt_tokens - 1)
                if last > first:
                    scored.append((seq, num_tokens + first - start, first, last - first))
            num_tokens += n
            drafts = seq.spec_tokens if end > seq.num_tokens else []
            input_ids.extend(seq.token_ids[start:end] if not drafts else [seq.last_token_id])
            input_ids.extend(drafts)  # [last token, d1 .. dk]: every position is verified
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            tables.append(table)
            # all computed: the last logits are needed (not for a prompt only scored)
            if end == seq.num_tokens + len(drafts) and seq.params.max_tokens > 0:
                wanted = 1 + len(drafts)
                logits_rows.extend(range(num_tokens - wanted, num_tokens))
                sample_seqs.append(seq)
                rows_per_seq.append(wanted)
        ids, pos, slot_mapping, rows = self.buffers.load(input_ids, positions, slots, logits_rows)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_lens_cpu=list(num_new_tokens),
            seq_lens_cpu=seq_lens,
            block_tables_cpu=tables,
            block_size=bs,
        )
        spec = len(logits_rows) > len(sample_seqs)
        return StepInputs(
            ids,
            pos,
            metadata,
            logits_rows,
            sample_seqs,
            rows,
            rows_per_seq if spec else None,
            scored=scored,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run the model over the step's tokens; logits [len(sample_seqs), V] float32 (rank 0
        of a group first sends the step to the other ranks, which run it with it)."""
        if self.group is not None and self.group.leads:
            from pdserve.engine.tp.commands import encode_step
            from pdserve.engine.tp.group import Command

            with self.group.lock:
                self.group.command(Command.STEP, encode_step(self.buffers.host, inputs))
                return self._execute(inputs)
        return self._execute(inputs)

    def _execute(self, inputs: StepInputs) -> torch.Tensor:
        hidden: torch.Tensor | None = None
        if self.graphs is not None and self.graphs.can_run(inputs.metadata):
            hidden = self.graphs.run(inputs)
        else:
            self.backend.plan(inputs.metadata)
            if self.compiled is not None:
                hidden = self.compiled.run(inputs.input_ids, inputs.positions, self.backend)
            elif self.native is not None and isinstance(self.backend, TorchAttentionBackend):
                planned = self.backend.native_decode()
                if planned is not None:
                    hidden = self.native.run(inputs.input_ids, inputs.positions, *planned)
        if hidden is None:
            layers = self.kv_cache.layers
            eager: torch.Tensor = self.model(
                inputs.input_ids, inputs.positions, layers, self.backend
            )
            hidden = eager
        if inputs.scored:
            inputs.prompt_logprobs = [self._score(hidden, *entry) for entry in inputs.scored]
        return self.model.compute_logits(hidden[inputs.logits_index])

    def _score(
        self, hidden: torch.Tensor, seq: Sequence, row: int, first: int, rows: int
    ) -> list[TokenLogprob]:
        """Logprobs of the prompt tokens after positions ``first ..`` of ``seq`` (token-batch
        rows ``row ..`` of hidden [T, H]), a slice of rows at a time: the logits of a long
        chunk at once would be [rows, V] float32."""
        k = seq.params.prompt_logprobs or 0
        out: list[TokenLogprob] = []
        for at in range(0, rows, SCORE_ROWS):
            count = min(SCORE_ROWS, rows - at)
            logits = self.model.compute_logits(hidden[row + at : row + at + count])
            targets = seq.token_ids[first + at + 1 : first + at + 1 + count]
            out += token_logprobs(logits, targets, [k] * count)
        return out


def _draft_config(config: EngineConfig) -> ModelConfig | None:
    """The draft model's config, when one speculates for this model (its KV shares blocks)."""
    spec = config.speculative
    if spec.mode != "draft" or spec.draft_model is None:
        return None
    return ModelConfig.from_dir(spec.draft_model)
