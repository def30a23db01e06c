"""Typed msgpack codec: frozen dataclasses in, ZMQ multipart frames out, and back.

Wire format of one message::

    frame 0      msgpack map {"type": <tag>, "v": PROTOCOL_VERSION, <field>: <value>, ...}
    frame 1..k   large ``bytes`` field values, each referenced from frame 0 as
                 ExtType(OOB_EXT, <frame index as uint32 LE>)

Nested dataclasses travel as plain maps of their fields. ``decode`` checks every field
against the dataclass's type hints and raises ``ProtocolError`` for anything else (unknown
tag, other version, missing/unexpected field, wrong type, bad frame reference, garbage bytes,
a value the dataclass's own ``__post_init__`` refuses with ``ValueError``).
Nothing is ever unpickled.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar, Union

import msgpack

PROTOCOL_VERSION = 4
OOB_EXT = 1  # msgpack ext code of an out-of-band frame reference
OOB_MIN_BYTES = 4096  # bytes values at least this large go out of band
_RESERVED = ("type", "v")

Buffer = bytes | bytearray | memoryview


class ProtocolError(ValueError):
    """A message that cannot be encoded, or bytes that are not a valid message."""


class Message:
    """Base of every top-level message; each is a frozen dataclass registered with
    ``@message(tag)``."""

    TYPE: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[str, ...]] = ()  # its field names in order, set with ``TYPE``


M = TypeVar("M", bound=type[Message])
T = TypeVar("T")
_REGISTRY: dict[str, type[Message]] = {}  # tag -> class, filled at import time only


def message(tag: str) -> Callable[[M], M]:
    """Register a frozen dataclass under ``tag`` (apply it above ``@dataclass``)."""

    def register(cls: M) -> M:
        if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        if tag in _REGISTRY:
            raise TypeError(f"message tag {tag!r} is already taken by {_REGISTRY[tag].__name__}")
        # compiling the checkers now makes an unsupported hint fail at import
        clash = [f for f in _RESERVED if f in _fields(cls)]
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
    fields (its bytes values travel inline)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: getattr(value, name) for name in _names(type(value))}
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
    refs = _Frames(frames)
    msg = _check_fields(cls, head, cls.__name__, refs)
    refs.check_all_used(cls.__name__)
    return msg


class _Ref(int):
    """An out-of-band frame index found in frame 0."""


def _ext_hook(code: int, data: bytes) -> Any:
    if code != OOB_EXT or len(data) != 4:
        raise ProtocolError(f"unknown msgpack extension {code} ({len(data)} bytes)")
    return _Ref(int.from_bytes(data, "little"))


class _Frames:
    def __init__(self, frames: Sequence[Buffer]) -> None:
        self.frames = frames
        self.used: set[int] = set()

    def take(self, ref: _Ref, path: str) -> bytes:
        if not 1 <= ref < len(self.frames) or ref in self.used:
            raise ProtocolError(f"{path}: bad frame reference {int(ref)}")
        self.used.add(ref)
        return bytes(self.frames[ref])

    def check_all_used(self, name: str) -> None:
        unused = len(self.frames) - 1 - len(self.used)
        if unused:
            raise ProtocolError(f"{name}: {unused} unreferenced extra frame(s)")


# ---- type checks from the dataclass hints -----------------------------------------------------

Checker = Callable[[Any, str, _Frames], Any]  # (wire value, path, frames) -> Python value


def _check_fields(cls: type[T], data: Mapping[object, object], path: str, refs: _Frames) -> T:
    fields = _fields(cls)
    missing = [name for name in fields if name not in data]
    if missing:
        raise ProtocolError(f"{path}: missing field {missing[0]!r}")
    unexpected = sorted(repr(k) for k in data if k not in fields)
    if unexpected:
        raise ProtocolError(f"{path}: unexpected field {', '.join(unexpected)}")
    kwargs = {name: check(data[name], f"{path}.{name}", refs) for name, check in fields.items()}
    try:
        return cls(**kwargs)
    except ValueError as e:  # a type that validates itself (``SamplingParams``): out of range
        raise ProtocolError(f"{path}: {e}") from None


# class -> its fields' checkers: a message's made when it registers, a nested one's on first use.
# A dict rather than ``functools.cache``, whose typed signature takes no class (mypy).
_CHECKERS: dict[type, dict[str, Checker]] = {}


def _fields(cls: type) -> dict[str, Checker]:
    fields = _CHECKERS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        fields = {f.name: _checker(hints[f.name]) for f in dataclasses.fields(cls)}
        _CHECKERS[cls] = fields
    return fields


def _describe(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _fail(path: str, tp: Any, value: Any) -> ProtocolError:
    got = "frame reference" if isinstance(value, _Ref) else type(value).__name__
    return ProtocolError(f"{path}: expected {_describe(tp)}, got {got}")


def _checker(tp: Any) -> Checker:  # one branch per supported hint
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"unsupported union {tp}: only `X | None`")
        check = _checker(inner[0])
        return lambda v, p, r: None if v is None else check(v, p, r)
    if origin is Literal:

        def literal(v: Any, p: str, r: _Frames) -> Any:
            if not any(type(v) is type(a) and v == a for a in args):
                raise ProtocolError(f"{p}: expected one of {list(args)}, got {v!r:.80}")
            return v

        return literal
    if origin is list:
        item = _checker(args[0])

        def list_(v: Any, p: str, r: _Frames) -> Any:
            if type(v) is not list:
                raise _fail(p, tp, v)
            return [item(x, f"{p}[{i}]", r) for i, x in enumerate(v)]

        return list_
    if origin is tuple:
        items = [_checker(a) for a in args]

        def tuple_(v: Any, p: str, r: _Frames) -> Any:
            if type(v) is not list or len(v) != len(items):
                raise _fail(p, tp, v)
            return tuple(
                c(x, f"{p}[{i}]", r) for i, (c, x) in enumerate(zip(items, v, strict=True))
            )

        return tuple_
    if origin is dict or tp is dict:
        key, val = (_checker(args[0]), _checker(args[1])) if args else (_any, _any)

        def dict_(v: Any, p: str, r: _Frames) -> Any:
            if type(v) is not dict:
                raise _fail(p, tp, v)
            return {key(k, f"{p} key", r): val(x, f"{p}[{k!r}]", r) for k, x in v.items()}

        return dict_
    if tp is Any:
        return _any
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):

        def nested(v: Any, p: str, r: _Frames) -> Any:
            if type(v) is not dict:
                raise _fail(p, tp, v)
            return _check_fields(tp, v, p, r)

        return nested
    if tp is bytes:

        def bytes_(v: Any, p: str, r: _Frames) -> Any:
            if isinstance(v, _Ref):
                return r.take(v, p)
            if type(v) is not bytes:
                raise _fail(p, tp, v)
            return v

        return bytes_
    if tp is float:

        def float_(v: Any, p: str, r: _Frames) -> Any:
            if type(v) not in (int, float):
                raise _fail(p, tp, v)
            return float(v)

        return float_
    if tp in (int, str, bool):

        def exact(v: Any, p: str, r: _Frames) -> Any:
            if type(v) is not tp:  # bool is not an int here, _Ref is not an int either
                raise _fail(p, tp, v)
            return v

        return exact
    raise TypeError(f"unsupported field type {tp!r}")


def _any(v: Any, p: str, r: _Frames) -> Any:
    stack = [v]  # iterative: garbage may nest deeper than Python's recursion limit
    while stack:
        x = stack.pop()
        if isinstance(x, _Ref):
            raise ProtocolError(f"{p}: frame reference outside a bytes field")
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return v
