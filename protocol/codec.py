"""Typed msgpack codec: frozen dataclasses in, ZMQ multipart frames out, and back.

Wire format of one message::

    frame 0      msgpack map {"type": <tag>, "v": PROTOCOL_VERSION, <field>: <value>, ...}
    frame 1..k   large ``bytes`` field values, each referenced from frame 0 as
                 ExtType(OOB_EXT, <frame index as uint32 LE>)

Nested dataclasses travel as plain maps of their fields. ``decode`` checks every field
against the dataclass's type hints (``protocol.checks``) and raises ``ProtocolError`` for
anything else (unknown tag, other version, missing/unexpected field, wrong type, bad frame
reference, garbage bytes, a value the dataclass's own ``__post_init__`` refuses with
``ValueError``). Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import msgpack

from pdserve.protocol.checks import Buffer, Frames, ProtocolError, Ref, check_fields, field_checkers

PROTOCOL_VERSION = 14  # 5: WorkerLoad in Heartbeat and WorkerStatus; FinishReason; 6: Share,
# KVHeader.part and .last, KVAck.part (a transfer in parts); 7: GatewayHello.samples,
# ClusterState.plans (the planner); 8: KVLayout.weights; 9: WorkerCounters.steps;
# 10: WorkerLoad.growth_blocks, .expected_output_tokens, WorkerCounters.preemptions,
# .recomputed_tokens (KV by need); 11: Register.tensor_parallel_size (a worker is a
# tensor-parallel group; its size also reaches PlanReport.load as prefill_tp, decode_tp);
# 13: SamplingParams.prompt_logprobs, TokenChunk.prompt_logprobs, ServedModel.kind, the
# "embed" role, Embed and EmbedResult (protocol.embeddings), WorkerCounters.kv_transfers_failed;
# 14: ServedModel.degraded; ClusterState.rollouts, RolloutCommand and RolloutAnswer
# (protocol.rollouts), the "admin" role, LatencySamples.requests and .errors; Generate.trace,
# Reserve.trace, PrefillJob.trace (W3C trace context), TokenChunk.phases, TransferDone.phases,
# PrefillJob.phases (protocol.phases: where a request's time went)
OOB_EXT = 1  # msgpack ext code of an out-of-band frame reference
OOB_MIN_BYTES = 4096  # bytes values at least this large go out of band
_RESERVED = ("type", "v")


class Message:
    """Base of every top-level message; each is a frozen dataclass registered with
    ``@message(tag)``."""

    TYPE: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[str, ...]] = ()  # its field names in order, set with ``TYPE``


M = TypeVar("M", bound=type[Message])
_REGISTRY: dict[str, type[Message]] = {}  # tag -> class, filled at import time only


def message(tag: str) -> Callable[[M], M]:
    """Register a frozen dataclass under ``tag`` (apply it above ``@dataclass``)."""

    def register(cls: M) -> M:
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        if tag in _REGISTRY:
            raise TypeError(f"message tag {tag!r} is already taken by {_REGISTRY[tag].__name__}")
        # compiling the checkers now makes an unsupported hint fail at import
        clash = [f for f in _RESERVED if f in field_checkers(cls)]
        if clash:
            raise TypeError(f"{cls.__name__}: field names {clash} are reserved")
        cls.TYPE = tag
        cls.FIELDS = _names(cls)
        _REGISTRY[tag] = cls
        return cls

    return register


def registered() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


# ---- encode ----------------------------------------------------------------------------------


def encode(msg: Message) -> list[bytes]:
    """Frames for ``msg``. Not checked against its type hints here (our own typed code builds
    every message, and checking cost 20 µs a token chunk): the receiver's ``decode`` checks."""
    cls = type(msg)
    if _REGISTRY.get(getattr(cls, "TYPE", "")) is not cls:
        raise ProtocolError(f"{cls.__name__} is not a registered message")
    extra: list[bytes] = []
    head: dict[str, Any] = {"type": cls.TYPE, "v": PROTOCOL_VERSION}
    for name in cls.FIELDS:
        value = getattr(msg, name)
        if isinstance(value, bytes) and len(value) >= OOB_MIN_BYTES:
            extra.append(value)
            value = msgpack.ExtType(OOB_EXT, len(extra).to_bytes(4, "little"))
        head[name] = value
    try:
        return [msgpack.packb(head, use_bin_type=True, default=_nested), *extra]
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"{cls.__name__}: cannot encode: {exc}") from None


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _nested(value: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: a nested dataclass, as a map of its
    fields (its bytes values travel inline); an ``Enum`` that is not a ``str`` already
    (``Tier``), as its value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: getattr(value, name) for name in _names(type(value))}
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"cannot serialize {type(value).__name__}")


# ---- decode ----------------------------------------------------------------------------------


def decode(frames: Sequence[Buffer]) -> Message:
    """The message in ``frames``; ``ProtocolError`` for anything that is not a valid one."""
    if len(frames) == 0:
        raise ProtocolError("empty message: no frames")
    try:
        head = msgpack.unpackb(frames[0], raw=False, strict_map_key=True, ext_hook=_ext_hook)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types on garbage; all mean the same here
        raise ProtocolError(f"frame 0 is not valid msgpack: {exc}") from None
    if not isinstance(head, dict):
        raise ProtocolError(f"frame 0 must be a map, got {type(head).__name__}")
    tag = head.pop("type", None)
    if not isinstance(tag, str):
        raise ProtocolError(f"message type must be a str, got {type(tag).__name__}")
    cls = _REGISTRY.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    if "v" not in head:
        raise ProtocolError(f"{cls.__name__}: missing protocol version 'v'")
    version = head.pop("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            f"{cls.__name__}: protocol version {version!r}, expected {PROTOCOL_VERSION}"
        )
    refs = Frames(frames)
    msg = check_fields(cls, head, cls.__name__, refs)
    refs.check_all_used(cls.__name__)
    return msg


def _ext_hook(code: int, data: bytes) -> Any:
    if code != OOB_EXT or len(data) != 4:
        raise ProtocolError(f"unknown msgpack extension {code} ({len(data)} bytes)")
    return Ref(int.from_bytes(data, "little"))
