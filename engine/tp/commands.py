"""What rank 0 sends the other ranks of its group to run a step, and how they run each command.

A STEP's payload is one int64 tensor::

    [ T | N | S | ids: T | positions: T | slots: T | logits rows: N |
      query lens: S | seq lens: S | table lens: S | tables: sum(table lens) ]

T tokens, N rows to sample, S sequences: the inputs ``ModelRunner.prepare`` made on rank 0 (the
first four parts are its ``StepBuffers`` as they are). The other ranks hold no sequences: they
run the same tokens through their heads and give rank 0 their slice of the logits.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.tp.group import Command, TPGroup

if TYPE_CHECKING:
    from pdserve.engine.model_runner import ModelRunner, StepInputs


def encode_step(packed: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
    """The STEP payload of ``inputs``; ``packed``: the host buffer its tensors are views of
    (ids, positions, slots, rows, in that order)."""
    meta = inputs.metadata
    t, n = inputs.input_ids.numel(), len(inputs.logits_rows)
    tables = meta.block_tables_cpu
    head = [t, n, len(tables)]
    lens = [*meta.query_lens_cpu, *meta.seq_lens_cpu, *(len(b) for b in tables)]
    flat = list(itertools.chain.from_iterable(tables))
    return torch.cat(
        (
            torch.tensor(head, dtype=torch.long),
            packed[: 3 * t + n],
            torch.tensor(lens + flat, dtype=torch.long),
        )
    )


def decode_step(payload: torch.Tensor, runner: ModelRunner) -> StepInputs:
    """The step ``encode_step`` encoded, its tensors in ``runner``'s step buffers."""
    from pdserve.engine.model_runner import StepInputs

    t, n, s = (int(v) for v in payload[:3])
    body = payload[3 : 3 + 3 * t + n]
    ids, positions, slots, rows = runner.buffers.load_packed(body, t, n)
    rest = payload[3 + 3 * t + n :].tolist()
    query_lens, seq_lens, table_lens = rest[:s], rest[s : 2 * s], rest[2 * s : 3 * s]
    flat, tables, at = rest[3 * s :], [], 0
    for length in table_lens:
        tables.append(flat[at : at + length])
        at += length
    metadata = AttentionMetadata(
        slot_mapping=slots,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_tables_cpu=tables,
        block_size=runner.kv_cache.block_size,
    )
    logits_rows = body[3 * t :].tolist()
    return StepInputs(ids, positions, metadata, logits_rows, [], rows)


def follow(runner: ModelRunner, group: TPGroup) -> None:
    """A rank past 0: run rank 0's commands until STOP (or the group fails)."""
    from pdserve.engine.tp.staging import gather_heads, gather_heads_shm, scatter_heads

    while True:
        cmd, payload = group.next_command()
        if cmd is Command.STEP:
            runner.execute(decode_step(payload, runner))
        elif cmd is Command.COPY_BLOCKS:
            half = payload.numel() // 2
            runner.kv_cache.copy_local(payload[:half].tolist(), payload[half:].tolist())
        elif cmd is Command.GATHER_KV:  # rank 0 chose the same way: shared memory, else this
            if not gather_heads_shm(group, runner.kv_cache.layers, payload):
                gather_heads(group, runner.kv_cache.layers, payload)
        elif cmd is Command.SCATTER_KV:
            scatter_heads(group, runner.kv_cache.layers, payload)
        elif cmd is Command.STOP:
            return
