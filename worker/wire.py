"""Pieces both worker roles share: engine <-> wire conversions and the outbox interface."""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Protocol

from pdserve.engine.engine import LLMEngine, RequestOutput
from pdserve.kvtransfer.common import layout_of
from pdserve.protocol import messages as m
from pdserve.protocol.control import (
    TRANSFER_SECONDS_BUCKETS,
    Heartbeat,
    KVLayout,
    WorkerCounters,
    WorkerLoad,
)
from pdserve.protocol.keys import ChoiceKey
from pdserve.protocol.sampling import SamplingParams


class Outbox(Protocol):
    """Where a worker's messages go; sockets in a process, a list in a test."""

    def to_coordinator(self, msg: m.Message) -> None: ...

    def to_gateway(self, address: str, msg: m.Message) -> None: ...


class TokenBatcher:
    """A step's token chunks, sent as one ``TokenBatch`` per gateway by ``flush`` (at the end
    of the step, and before anything else goes to a gateway, so nothing overtakes them)."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.pending: dict[str, list[m.TokenChunk]] = {}

    def add(self, address: str, chunk: m.TokenChunk) -> None:
        self.pending.setdefault(address, []).append(chunk)

    def flush(self) -> None:
        pending, self.pending = self.pending, {}
        for address, chunks in pending.items():
            self.outbox.to_gateway(address, m.TokenBatch(chunks=chunks))


@dataclass(frozen=True)
class PromptKey:
    """The engine id of a prompt run once for the choices from ``choice`` on (engine/fork.py);
    never reported, and never equal to a choice's ``ChoiceKey`` (a dataclass, not a tuple)."""

    request_id: str
    choice: int

    def __str__(self) -> str:  # for logs
        return f"{self.request_id}#{self.choice}+prompt"


def transfer_id(key: ChoiceKey) -> str:
    """The id a KV transfer goes by on the transfer wire, the same on the sending and the
    receiving worker: ``"<request id>#<choice>"`` of the choice that leads the transfer."""
    return f"{key.request_id}#{key.choice}"


def token_chunk(
    key: ChoiceKey,
    out: RequestOutput,
    index: int,
    token_ids: list[int],
    reason: str | None,
    phases: dict[str, float] | None = None,
) -> m.TokenChunk:
    """``token_ids`` of ``out`` for choice ``key``, the first at ``index``; ``reason``: why the
    choice ends with them (a ``FinishReason`` value; None: it goes on); ``phases``: this
    worker's of the request, on its first chunk (``protocol.phases``)."""
    return m.TokenChunk(
        request_id=key.request_id,
        choice=key.choice,
        index=index,
        token_ids=token_ids,
        logprobs=out.new_logprobs or None,
        finished=reason is not None,
        finish_reason=None if reason is None else m.FinishReason(reason),
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        prompt_logprobs=out.prompt_logprobs,
        phases=phases,
    )


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Choice ``c`` of a seeded request draws from seed + c, so its ``n`` choices differ and
    each is the same whichever worker runs it."""
    if params.seed is None or not choice:
        return params
    return dataclasses.replace(params, seed=params.seed + choice)


def kv_layout(engine: LLMEngine) -> KVLayout:
    """What this engine's blocks look like to another worker (``Register.layout``), with the
    weights that compute them."""
    weights = engine.runner.model.quantization
    own = layout_of(engine.runner.kv_cache.layers)  # a tensor-parallel rank's: its heads
    whole = engine.model_config.num_kv_heads  # what moves between workers: every head
    draft = engine.spec.draft if engine.spec is not None else None
    return dataclasses.replace(
        own,
        weights=weights,
        num_kv_heads=whole,
        draft=draft.describe() if draft is not None else "",
    )


class TransferStats:
    """KV pushes a worker made: blocks, bytes and time taken (``WorkerCounters``).
    ``ended`` may be called from a transfer thread."""

    def __init__(self) -> None:
        self.blocks = 0
        self.bytes = 0
        self.seconds_sum = 0.0
        self.counts = [0] * (len(TRANSFER_SECONDS_BUCKETS) + 1)

    def started(self, blocks: int, bytes_per_block: int) -> None:
        self.blocks += blocks
        self.bytes += blocks * bytes_per_block

    def ended(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.seconds_sum += seconds
        self.counts[bisect.bisect_left(TRANSFER_SECONDS_BUCKETS, seconds)] += 1


def block_bytes(engine: LLMEngine) -> int:
    """Bytes of KV one block holds, over every layer and head (what moving it costs)."""
    layout = kv_layout(engine)
    itemsize = engine.runner.kv_cache.layers[0].element_size()
    layers = len(engine.status.kv_layers)  # a draft model's layers move too
    return layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim * itemsize


def worker_counters(
    engine: LLMEngine, transfers: TransferStats | None = None, kv_failures: int = 0
) -> WorkerCounters:
    """This worker's totals since it started (every role's heartbeat): prompt tokens, KV
    pushed (``transfers``: a worker that pushes none has no transfer histogram), transfers
    failed here (``Worker.kv_failures``) and steps."""
    t = transfers or TransferStats()
    return WorkerCounters(
        prefix_hit_tokens=engine.status.prefix_hit_tokens,
        prefill_tokens=engine.prefill_tokens_computed,
        preemptions=engine.status.preemptions,
        recomputed_tokens=engine.recomputed_tokens,
        kv_blocks_sent=t.blocks,
        kv_bytes_sent=t.bytes,
        kv_transfers_failed=kv_failures,
        transfer_seconds_sum=t.seconds_sum,
        transfer_seconds_counts=list(t.counts) if transfers is not None else [],
        steps=engine.step_counters(),
        spec=engine.spec_counters(),
    )


def heartbeat(
    engine: LLMEngine,
    worker_id: str,
    queued_prompt_tokens: int,
    draining: bool = False,
    transfers: TransferStats | None = None,
    kv_failures: int = 0,
) -> Heartbeat:
    """This worker's load and totals now (built on the loop thread, the only one touching the
    engine)."""
    status = engine.status
    load = WorkerLoad(
        free_blocks=status.num_free_blocks,
        used_blocks=status.num_used_blocks,
        total_blocks=status.num_blocks,
        running=status.num_running,
        waiting=status.num_waiting,
        queued_prompt_tokens=queued_prompt_tokens,
        draining=draining,
        growth_blocks=status.growth_blocks,
        expected_output_tokens=status.expected_output_tokens,
    )
    counters = worker_counters(engine, transfers, kv_failures)
    return Heartbeat(worker_id=worker_id, load=load, counters=counters)
