"""Decoding's checks: each field of a message against its dataclass's type hints, and the
error for anything that is not a valid message (``ProtocolError``).

A class's checkers are compiled once from its hints (a message's when it registers, so an
unsupported hint fails at import; a nested one's on first use), one per field: a function of
(wire value, path, frames) that returns the Python value or raises ``ProtocolError`` naming
the path (``Generate.sampling.top_p``). Which builder makes a checker is looked up by the
hint's kind (``_BY_ORIGIN``: ``X | None``, ``Literal``, list, tuple, dict; ``_BY_TYPE``:
bytes, float, int, str, bool; else an ``Enum`` or a nested dataclass).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")


class ProtocolError(ValueError):
    """A message that cannot be encoded, or bytes that are not a valid message."""


class Ref(int):
    """An out-of-band frame index found in frame 0."""


class Frames:
    """A message's frames, and which of them its fields have taken (each exactly once)."""

    def __init__(self, frames: Sequence[Buffer]) -> None:
        self.frames = frames
        self.used: set[int] = set()

    def take(self, ref: Ref, path: str) -> bytes:
        if not 1 <= ref < len(self.frames) or ref in self.used:
            raise ProtocolError(f"{path}: bad frame reference {int(ref)}")
        self.used.add(ref)
        return bytes(self.frames[ref])

    def check_all_used(self, name: str) -> None:
        unused = len(self.frames) - 1 - len(self.used)
        if unused:
            raise ProtocolError(f"{name}: {unused} unreferenced extra frame(s)")


Checker = Callable[[Any, str, Frames], Any]  # (wire value, path, frames) -> Python value


def check_fields(cls: type[T], data: Mapping[object, object], path: str, refs: Frames) -> T:
    """``cls`` built from the map ``data`` of its fields, each checked against its hint;
    ``ProtocolError`` naming ``path`` (and the field) for anything else."""
    fields = field_checkers(cls)
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


def field_checkers(cls: type) -> dict[str, Checker]:
    """The checker of each field of ``cls``, compiled on the first call."""
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
    got = "frame reference" if isinstance(value, Ref) else type(value).__name__
    return ProtocolError(f"{path}: expected {_describe(tp)}, got {got}")


def _checker(tp: Any) -> Checker:
    """The checker of one type hint, built by the entry of ``_BY_ORIGIN`` (generic and special
    forms) or ``_BY_TYPE`` (plain types) that fits it."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    build = _BY_ORIGIN.get(dict if tp is dict else origin)
    if build is not None:
        return build(tp, args)
    if tp is Any:
        return _any
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return _enum(tp)
        if dataclasses.is_dataclass(tp):
            return _dataclass(tp)
        if tp in _BY_TYPE:
            return _BY_TYPE[tp](tp)
    raise TypeError(f"unsupported field type {tp!r}")


def _optional(tp: Any, args: tuple[Any, ...]) -> Checker:
    inner = [a for a in args if a is not type(None)]
    if len(inner) != 1 or len(args) != 2:
        raise TypeError(f"unsupported union {tp}: only `X | None`")
    check = _checker(inner[0])
    return lambda v, p, r: None if v is None else check(v, p, r)


def _literal(tp: Any, args: tuple[Any, ...]) -> Checker:
    def literal(v: Any, p: str, r: Frames) -> Any:
        if not any(type(v) is type(a) and v == a for a in args):
            raise ProtocolError(f"{p}: expected one of {list(args)}, got {v!r:.80}")
        return v

    return literal


def _list(tp: Any, args: tuple[Any, ...]) -> Checker:
    item = _checker(args[0])

    def list_(v: Any, p: str, r: Frames) -> Any:
        if type(v) is not list:
            raise _fail(p, tp, v)
        return [item(x, f"{p}[{i}]", r) for i, x in enumerate(v)]

    return list_


def _tuple(tp: Any, args: tuple[Any, ...]) -> Checker:
    items = [_checker(a) for a in args]

    def tuple_(v: Any, p: str, r: Frames) -> Any:
        if type(v) is not list or len(v) != len(items):
            raise _fail(p, tp, v)
        return tuple(c(x, f"{p}[{i}]", r) for i, (c, x) in enumerate(zip(items, v, strict=True)))

    return tuple_


def _dict(tp: Any, args: tuple[Any, ...]) -> Checker:
    key, val = (_checker(args[0]), _checker(args[1])) if args else (_any, _any)

    def dict_(v: Any, p: str, r: Frames) -> Any:
        if type(v) is not dict:
            raise _fail(p, tp, v)
        return {key(k, f"{p} key", r): val(x, f"{p}[{k!r}]", r) for k, x in v.items()}

    return dict_


_BY_ORIGIN: dict[Any, Callable[[Any, tuple[Any, ...]], Checker]] = {
    Union: _optional,
    types.UnionType: _optional,
    Literal: _literal,
    list: _list,
    tuple: _tuple,
    dict: _dict,
}


def _enum(tp: type[enum.Enum]) -> Checker:
    by_value = {member.value: member for member in tp}

    def enum_(v: Any, p: str, r: Frames) -> Any:
        member = by_value.get(v) if type(v) in (int, str) else None
        if member is None or type(v) is not type(member.value):
            raise ProtocolError(f"{p}: expected one of {list(by_value)}, got {v!r:.80}")
        return member

    return enum_


def _dataclass(tp: type) -> Checker:
    def nested(v: Any, p: str, r: Frames) -> Any:
        if type(v) is not dict:
            raise _fail(p, tp, v)
        return check_fields(tp, v, p, r)

    return nested


def _bytes(tp: type) -> Checker:
    def bytes_(v: Any, p: str, r: Frames) -> Any:
        if isinstance(v, Ref):
            return r.take(v, p)
        if type(v) is not bytes:
            raise _fail(p, tp, v)
        return v

    return bytes_


def _float(tp: type) -> Checker:
    def float_(v: Any, p: str, r: Frames) -> Any:
        if type(v) not in (int, float):
            raise _fail(p, tp, v)
        return float(v)

    return float_


def _exact(tp: type) -> Checker:
    def exact(v: Any, p: str, r: Frames) -> Any:
        if type(v) is not tp:  # bool is not an int here, Ref is not an int either
            raise _fail(p, tp, v)
        return v

    return exact


_BY_TYPE: dict[type, Callable[[type], Checker]] = {
    bytes: _bytes,
    float: _float,
    int: _exact,
    str: _exact,
    bool: _exact,
}


def _any(v: Any, p: str, r: Frames) -> Any:
    stack = [v]  # iterative: garbage may nest deeper than Python's recursion limit
    while stack:
        x = stack.pop()
        if isinstance(x, Ref):
            raise ProtocolError(f"{p}: frame reference outside a bytes field")
        if isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return v
