"""The messages of a request's lifecycle, and the cluster's state as gateways see it (the
codec is in ``protocol.codec``; what workers say of themselves, in ``protocol.control``).

Who sends what::

    worker      ── Register, Heartbeat, KVEvents (protocol.control) ─▶ coordinator
    gateway     ── Generate, Abort; GatewayHello; Embed (protocol.embeddings) ▶ coordinator
    coordinator ── ClusterState (models, each worker's WorkerStatus) ─▶ gateway
    coordinator ── Reserve ─▶ decode ── Reserved ────────────────▶ coordinator
    coordinator ── PrefillJob ─▶ prefill ── TransferDone ─▶ coordinator ─▶ decode
    coordinator ── Accepted (a choice has its workers), RequestError ─▶ gateway
    coordinator ── Abort ────────────────────────────────────────▶ prefill, decode
    prefill (token 0), decode (1..n) ── TokenBatch (a step's chunks) ─▶ gateway
    prefill, decode ── Finished (one choice is over here) ───────▶ coordinator
    any         ── RequestError ─────────────────────────────────▶ coordinator / gateway
    kv sender   ── KVHeader + one raw frame per layer ───────────▶ kv receiver

To add a message: a frozen dataclass with ``@message("<tag>")`` above ``@dataclass``; fields
may be int, float, str, bool, bytes, an ``Enum``, ``X | None``, ``Literal[...]``,
list/tuple/dict of those, or a nested (unregistered) frozen dataclass; one that checks its
values in ``__post_init__`` (``SamplingParams``) raises ``ValueError``, which decode reports as
a ``ProtocolError``. Bump ``PROTOCOL_VERSION`` when an existing message changes. A type with
more than three fields is built by keyword (``kw_only``): nine arguments by position are
unreadable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from pdserve.protocol.checks import ProtocolError
from pdserve.protocol.codec import PROTOCOL_VERSION, Message, decode, encode, message
from pdserve.protocol.control import Role, WorkerCounters, WorkerLoad
from pdserve.protocol.embeddings import Embed, EmbedResult
from pdserve.protocol.planning import LatencySamples, PlanReport
from pdserve.protocol.rollouts import Rollout
from pdserve.protocol.sampling import SamplingParams, StructuredSpec
from pdserve.protocol.tenancy import Share, Tier

__all__ = [  # its own types, and the codec and sampling names its users read through it
    "PROTOCOL_VERSION",
    "Abort",
    "Accepted",
    "ClusterState",
    "Embed",
    "EmbedResult",
    "FinishReason",
    "Finished",
    "GatewayHello",
    "Generate",
    "KVHeader",
    "LatencySamples",
    "Message",
    "PlanReport",
    "PrefillJob",
    "ProtocolError",
    "RequestError",
    "Reserve",
    "Reserved",
    "Rollout",
    "SamplingParams",
    "ServedModel",
    "Share",
    "StructuredSpec",
    "Tier",
    "TokenBatch",
    "TokenChunk",
    "TokenLogprob",
    "TransferDone",
    "WorkerStatus",
    "decode",
    "encode",
]

# ---- nested parts ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """One sampled token's logprob: the engine's sampler makes it, the wire and the gateway
    pass it on as it is."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # (token id, logprob) alternatives, most likely first


# ---- gateways -------------------------------------------------------------------------------


@message("gateway_hello")
@dataclass(frozen=True)
class GatewayHello(Message):
    """Gateway → coordinator, about once a second: where to send its ``ClusterState``, and the
    latencies of the requests that ended since (the planner's, ``protocol.planning``)."""

    stream_address: str
    samples: list[LatencySamples] = field(default_factory=list)  # one per model


@dataclass(frozen=True, kw_only=True)
class ServedModel:
    name: str
    root: str
    max_model_len: int
    ready: bool  # at least one worker can prefill and one can decode it (embed: one embeds)
    kind: Literal["generate", "embed"] = "generate"  # embed: served by /v1/embeddings only
    # ready, but with a part of it gone (``coordinator.registry.ModelState``): "no_prefill"
    # (decode workers prefill new requests themselves), "holding" (no worker can decode it
    # now: a request waits up to the coordinator's --hold-timeout for one); "": whole
    degraded: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkerStatus:
    """One worker, as the coordinator last heard of it (``/metrics`` shows it)."""

    role: Role
    worker_id: str
    model: str
    load: WorkerLoad
    counters: WorkerCounters = field(default_factory=WorkerCounters)


@message("cluster_state")
@dataclass(frozen=True, kw_only=True)
class ClusterState(Message):
    """Coordinator → gateway, in answer to each ``GatewayHello``."""

    models: list[ServedModel]
    workers: list[WorkerStatus]
    coordinator_id: str = ""  # new at each coordinator start: a gateway sees a restart
    routing: dict[str, int] = field(default_factory=dict)  # decisions so far, by reason
    plans: list[PlanReport] = field(default_factory=list)  # the planner's, one per model
    # each name's versions and their shares of its requests (``protocol.rollouts``)
    rollouts: list[Rollout] = field(default_factory=list)


# ---- request lifecycle -----------------------------------------------------------------------


@message("generate")
@dataclass(frozen=True, kw_only=True)
class Generate(Message):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    n: int
    stream_address: str  # the gateway's token-stream address
    # migration: continue one choice whose worker died, after the tokens it already streamed
    resume_choice: int | None = None
    resume_token_ids: list[int] = field(default_factory=list)
    # who it is for (tenant, tier, weight, the request's priority): the order it waits in,
    # here and on the workers; None: ``protocol.tenancy.DEFAULT``
    share: Share | None = None
    trace: str = ""  # W3C traceparent of the gateway's span (runtime/tracing.py); "": none


@message("reserve")
@dataclass(frozen=True, kw_only=True)
class Reserve(Message):
    """Coordinator → decode: hold blocks for the prompt's KV and remember the request."""

    request_id: str
    prompt_token_ids: list[int]  # blocks are reserved for len(prompt_token_ids) tokens
    sampling: SamplingParams
    n: int
    stream_address: str
    choice: int = 0  # the first choice this reservation is for
    # choices ``choice .. choice + choices - 1`` share it: their prompt is prefilled and moved
    # once, then forked here (engine/fork.py); blocks for each one's tail come with it
    choices: int = 1
    share: Share | None = None  # ``Generate.share``: the order its choices wait in here
    trace: str = ""  # traceparent of the coordinator's span of it ("": untraced)


@message("reserved")
@dataclass(frozen=True, kw_only=True)
class Reserved(Message):
    """Decode → coordinator: the reserved block ids, or ``error`` (and no blocks)."""

    request_id: str
    worker_id: str
    block_ids: list[int]
    transfer_address: str
    error: str | None = None
    choice: int = 0
    free_blocks: int = -1  # the worker's free KV blocks after this answer (-1: unknown)
    # random per reservation: the KV sender must present it (nixl and nccl have no CURVE)
    transfer_secret: bytes = b""
    # leading blocks of ``block_ids`` the decode worker already holds (its prefix cache): the
    # prefill worker moves only the rest
    cached_blocks: int = 0


@message("prefill_job")
@dataclass(frozen=True, kw_only=True)
class PrefillJob(Message):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    n: int
    dst_block_ids: list[int]  # on the decode worker, in token order
    transfer_address: str  # the decode worker's KV receiver
    stream_address: str  # token 0 goes straight to the gateway
    choice: int = 0
    # run here, no transfer (empty dst_block_ids): recompute these tokens, continue after them
    generated_token_ids: list[int] = field(default_factory=list)
    transfer_secret: bytes = b""  # the decode worker's ``Reserved.transfer_secret``
    skip_blocks: int = 0  # ``Reserved.cached_blocks``: leading blocks not to move
    choices: int = 1  # as ``Reserve.choices``: one prompt run for them all, token 0 each
    share: Share | None = None  # ``Generate.share``: the order it waits in here
    trace: str = ""  # as ``Reserve.trace``
    # the coordinator's phases of it (coordinator_wait), passed on with token 0
    phases: dict[str, float] = field(default_factory=dict)


@message("transfer_done")
@dataclass(frozen=True, kw_only=True)
class TransferDone(Message):
    """Prefill → coordinator → decode: the KV push ended (``error`` set when it failed, and
    the decode worker's failure policy decides); token 0 of each choice rides along:
    ``first_token_ids[i]`` (and ``first_logprobs[i]``) is choice ``choice + i``'s."""

    request_id: str
    first_token_ids: list[int]
    first_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill worker found in its prefix cache
    choice: int = 0
    error: str | None = None
    ended: list[int] = field(default_factory=list)  # choices token 0 ended (not to decode)
    # the prefill worker's phases of it, seconds by ``protocol.phases.Phase`` (kv_transfer):
    # the decode worker passes them on with its first token
    phases: dict[str, float] = field(default_factory=dict)


class FinishReason(StrEnum):
    """Why a choice ended: ``STOP`` (an eos or stop token), ``LENGTH`` (``max_tokens`` or the
    model's length), ``ABORT`` (cancelled, or failed). A ``str``: it goes on the wire and into
    OpenAI's ``finish_reason`` as its value."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, kw_only=True)
class TokenChunk:
    """New tokens of one choice; ``index`` is the position of ``token_ids[0]`` in the output."""

    request_id: str
    choice: int
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: FinishReason | None  # when finished
    num_prompt_tokens: int
    num_cached_tokens: int
    # with token 0 (``SamplingParams.prompt_logprobs``): prompt tokens 1.. scored, in order
    prompt_logprobs: list[TokenLogprob] | None = None
    # on a choice's first chunk from each worker: where its time went there, seconds by
    # ``protocol.phases.Phase`` (durations, never timestamps: clocks differ between machines)
    phases: dict[str, float] | None = None


@message("token_batch")
@dataclass(frozen=True)
class TokenBatch(Message):
    """One worker step's new tokens for one gateway: a chunk per choice it advanced (one
    message a step, however many streams)."""

    chunks: list[TokenChunk]


@message("accepted")
@dataclass(frozen=True)
class Accepted(Message):
    """Coordinator → gateway: one choice has its workers (decode blocks reserved, the prefill
    job sent). Until then the request may still be refused (``RequestError``), and the HTTP
    response, streamed or not, has not begun."""

    request_id: str
    choice: int


@message("finished")
@dataclass(frozen=True)
class Finished(Message):
    """Worker → coordinator: one choice of a request is over on this worker (blocks freed)."""

    request_id: str
    choice: int
    worker_id: str


@message("abort")
@dataclass(frozen=True)
class Abort(Message):
    request_id: str
    reason: str
    choice: int | None = None  # None: every choice of the request


@message("request_error")
@dataclass(frozen=True, kw_only=True)
class RequestError(Message):
    request_id: str
    status: int  # HTTP status the gateway answers with (429, 503, 500, ...)
    message: str
    choice: int | None = None  # the choice that failed; None: the whole request
    retryable: bool = False  # its worker died mid-stream: the gateway may resume it elsewhere


# ---- KV transfer -----------------------------------------------------------------------------


@message("kv_header")
@dataclass(frozen=True, kw_only=True)
class KVHeader(Message):
    """First frame of a KV transfer; one buffer per layer follows it.

    Layer buffer l: ``[len(dst_block_ids), *block_shape]`` elements of ``dtype``, the source
    blocks in ``dst_block_ids`` order, C-contiguous.
    """

    request_id: str
    dst_block_ids: list[int]
    src_block_ids: list[int] = field(default_factory=list)  # pull transports read these
    num_layers: int
    dtype: str
    block_shape: list[int]  # [2, block_size, num_kv_heads, head_dim]
    checksum: bytes | None  # CRC-32 (big-endian) over every layer buffer in order, or None
    secret: bytes = b""  # the reservation's transfer secret: nothing else is accepted
    # a transfer offered in parts (nixl, ``--kv-stream-chunks``): this offer's index, from 0,
    # its blocks following the previous offer's; ``last``: none follows, the transfer is
    # whole once every offer was read. One offer: part 0, last.
    part: int = 0
    last: bool = True
