"""The workers' side of the control plane: what a worker tells the coordinator about itself.

    worker ── Register (each period: role, model, KV layout, blocks) ──▶ coordinator
           ── Heartbeat (each period: WorkerLoad, WorkerCounters) ─────▶ coordinator
           ── KVEvents (beside each heartbeat: its prefix cache) ──────▶ coordinator

A worker's load (``WorkerLoad``) is one type from the worker's heartbeat through the
coordinator's registry (which estimates it between heartbeats) to the gateway's ``/metrics``
(``messages.WorkerStatus``). The request lifecycle's messages are in ``protocol.messages``; the
rules for adding a message are in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdserve.protocol.codec import Message, message

Role = Literal["prefill", "decode", "both", "embed"]  # embed: an embedding model's worker

# upper bounds (seconds) of the KV-transfer-time histogram a worker reports, then +Inf
TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# The engine's steps (engine/step_stats.py), by kind: ``decode`` (decode tokens only), ``mixed``
# (decode tokens and prompt chunks: the steps a TPOT target caps), ``prefill`` (prompt chunks
# only: no stream waits on them). Upper bounds of each histogram, then +Inf.
STEP_KINDS = ("decode", "mixed", "prefill")
STEP_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
STEP_PREFILL_TOKENS_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
STEP_DECODE_SEQS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
# Why a step carrying decodes ran over the TPOT target: ``decodes`` (its decodes alone were
# predicted over it: more streams than the target allows), ``age_bound`` (a prompt that went
# the age bound without a token took tokens the target had no room for), ``misprediction`` (it
# was predicted within the target: the step-time model was off, or the machine was busy).
OVER_TARGET_REASONS = ("decodes", "age_bound", "misprediction")
# The step-time model's terms (engine/step_model.py), in ``StepCounters.model``'s order
STEP_MODEL_TERMS = ("fixed", "per_prefill_token", "per_decode_seq", "batched")
# Speculative decoding (engine/spec/): why an engine step that ran decodes did or did not verify
# drafts. ``speculated``: it did; ``no_drafts``: no decoding sequence had a proposal;
# ``not_worth``: the step-time model priced the verification above the tokens it expected
# (large batches, low acceptance); ``no_room``: the step's token budget or free blocks left no
# slots for drafts; ``switched_off``: the worker's switch is off.
SPEC_STEP_REASONS = ("speculated", "no_drafts", "not_worth", "no_room", "switched_off")
SPEC_MODES = ("off", "ngram", "draft")
MAX_SPEC_POSITIONS = 16  # drafts verified per sequence a step, at most (engine/config.py)
# ranks of one tensor-parallel group (engine/tp/): more than any group spans
MAX_TENSOR_PARALLEL_SIZE = 1024


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """What two workers must agree on to exchange KV blocks (``kvtransfer.check_layouts``)."""

    block_size: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # the model's weight form (CausalLM.quantization: "none", "int8", "gguf Q4_1+Q8_0", ...):
    # blocks computed from other weights hold other values, so such workers never pair
    weights: str = ""
    # a draft model's KV kept beside the target's (speculative decoding: engine/spec/draft.py):
    # its layers follow the target's ``num_layers`` in every block moved; "" when none. Its
    # name, layers and weight form, e.g. "smollm2-135m-instruct 30 layers int4"
    draft: str = ""


@dataclass(frozen=True, kw_only=True)
class KVRegions:
    """Where a worker's KV cache lives for a transport that reads or writes it remotely: one
    region per layer (``[num_blocks, 2, block_size, H, D]`` contiguous, block ``b`` of layer
    ``l`` at ``layer_addrs[l] + b * block_bytes``) in ``mem`` ("DRAM" or "VRAM")."""

    agent: str  # the transport agent's name (NIXL)
    metadata: bytes  # the agent's own metadata blob (NIXL's format, not Python's pickle)
    mem: str
    device_id: int
    layer_addrs: list[int]
    block_bytes: int
    num_blocks: int
    layout: KVLayout


@message("register")
@dataclass(frozen=True, kw_only=True)
class Register(Message):
    role: Role
    worker_id: str
    model: str
    control_address: str  # where the coordinator sends Reserve / PrefillJob / Abort
    transfer_address: str  # KV receiver address ("" for a prefill-only worker)
    transfer_backend: str  # "zmq" | "nixl" | ...; paired workers must use the same one
    layout: KVLayout
    num_blocks: int
    model_root: str = ""  # where the weights live (``root`` in /v1/models)
    max_model_len: int = 0
    kv_regions: KVRegions | None = None  # one-sided transports (nixl; ``protocol.transfer``)
    # the ranks of its tensor-parallel group (engine/tp/): a group registers as one worker, its
    # rank 0; the planner sizes each pool with the model's profile at its workers' size
    tensor_parallel_size: int = 1


@dataclass(frozen=True, kw_only=True)
class WorkerLoad:
    """A worker's load: its KV blocks and its requests, as it last reported them (or as the
    coordinator estimates them since: ``coordinator.registry``)."""

    free_blocks: int
    used_blocks: int
    total_blocks: int
    running: int  # requests it runs
    waiting: int  # requests its engine has queued
    queued_prompt_tokens: int  # prompt tokens it has still to compute
    draining: bool = False  # finishing what it has, taking nothing new (SIGTERM)
    # admission by need (engine/output_lengths.py): blocks its sequences are expected to take
    # still as they decode, and the output tokens a new one is expected to produce (0: none
    # finished yet); placement counts on ``free_blocks - growth_blocks``
    growth_blocks: int = 0
    expected_output_tokens: int = 0

    @classmethod
    def idle(cls, num_blocks: int) -> WorkerLoad:
        """Every block free and nothing to do: a worker before its first heartbeat."""
        return cls(
            free_blocks=num_blocks,
            used_blocks=0,
            total_blocks=num_blocks,
            running=0,
            waiting=0,
            queued_prompt_tokens=0,
        )


@dataclass(frozen=True, kw_only=True)
class StepHistogram:
    """One kind of step (``STEP_KINDS``): counts per bucket of each histogram (one count per
    bound of its ``STEP_*_BUCKETS`` and one past the last, not cumulative) and sums."""

    seconds_counts: list[int]
    seconds_sum: float
    prefill_tokens_counts: list[int]
    prefill_tokens_sum: int
    decode_seqs_counts: list[int]
    decode_seqs_sum: int


@dataclass(frozen=True, kw_only=True)
class StepCounters:
    """A worker's engine steps since it started and how it sizes them (``/metrics``)."""

    tpot_target_s: float = 0.0  # what a step carrying decodes should take; 0: no target
    # the step-time model now, seconds, one a ``STEP_MODEL_TERMS``; empty when there is none
    model: list[float] = field(default_factory=list)
    by_kind: dict[str, StepHistogram] = field(default_factory=dict)  # STEP_KINDS that ran
    over_target: dict[str, int] = field(default_factory=dict)  # OVER_TARGET_REASONS -> steps


@dataclass(frozen=True, kw_only=True)
class SpecCounters:
    """A worker's speculative decoding since it started (``/metrics``); empty when it has
    none (``mode`` "off")."""

    mode: str = "off"  # SPEC_MODES
    # per draft position (a sequence's 1st draft in a step, 2nd, ...; at most
    # MAX_SPEC_POSITIONS): drafts verified there, and of those the ones accepted (kept with
    # every draft before it: accepted[i] / drafted[i] is the chance position i's is kept)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    steps: dict[str, int] = field(default_factory=dict)  # SPEC_STEP_REASONS -> decode steps
    draft_tokens: int = 0  # tokens the draft model computed (catching up and drafting)
    # of those, prompt tokens: 0 on a decode worker whose prompts' draft KV came with the
    # target's from a prefill worker
    draft_prompt_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class WorkerCounters:
    """A worker's totals since it started (``Heartbeat`` → ``ClusterState`` → ``/metrics``)."""

    prefix_hit_tokens: int = 0  # prompt tokens whose KV its prefix cache already held
    prefill_tokens: int = 0  # tokens it computed in prompt chunks (recomputation included)
    preemptions: int = 0  # sequences whose blocks a step took back, to be recomputed
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    kv_blocks_sent: int = 0  # KV blocks it pushed to decode workers
    kv_bytes_sent: int = 0
    kv_transfers_failed: int = 0  # pushes that failed (timed out, refused, a broken link)
    transfer_seconds_sum: float = 0.0
    # pushes that ended (done or failed) by time taken: one count per
    # ``TRANSFER_SECONDS_BUCKETS`` bound and one past the last (not cumulative); empty: none
    transfer_seconds_counts: list[int] = field(default_factory=list)
    steps: StepCounters = field(default_factory=StepCounters)
    spec: SpecCounters = field(default_factory=SpecCounters)


@message("heartbeat")
@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    worker_id: str
    load: WorkerLoad
    counters: WorkerCounters = field(default_factory=WorkerCounters)


@message("kv_events")
@dataclass(frozen=True, kw_only=True)
class KVEvents(Message):
    """Worker → coordinator, beside each heartbeat: the prefix-cache block hashes
    (``protocol.prefix``) it stored and evicted since its last message, at most
    ``MAX_KV_EVENT_HASHES`` a message; or, with ``snapshot``, every hash it holds, in ``parts``
    messages sent back to back (at its start, now and then after, and when its log of changes
    overflowed), which replace what the coordinator knew of it."""

    worker_id: str
    epoch: str  # random per worker process: a new one means the worker restarted
    seq: int  # consecutive within an epoch: a gap means messages were lost
    stored: list[int]
    evicted: list[int] = field(default_factory=list)
    snapshot: bool = False
    part: int = 0  # of a snapshot: this message's index among ``parts``
    parts: int = 1
