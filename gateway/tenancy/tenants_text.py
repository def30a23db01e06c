"""The tenants file as text: where a tenant's table and fields are written (the line numbers
of ``TenantsError``), and the one edit ``pdserve keys`` makes: a key hash added to or removed
from a tenant's ``keys`` array, every other byte of the file kept (comments included).

Read as lines: in a file that loads, a line that starts with ``[`` is a table's header (its
only arrays hold strings, and no string it accepts holds such a line). What can be edited:

    [tenants.acme]                  # or [tenants."a.b"]; not an inline table, not dotted keys
    keys = ["sha256:…", "sha256:…"] # one line, or one key a line (each with its comment):
    keys = [
        "sha256:…",  # alice's laptop
    ]

Anything else is refused with ``EditError``; ``launch/keys.py`` loads every edit's result and
compares it with what was meant before the file is replaced.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass


class EditError(ValueError):
    """An edit the tenants file's text cannot take as it is written (edit it by hand)."""


def quoted_key(name: str) -> str:
    """A regex for the TOML key ``name`` as it may be written: bare or quoted."""
    bare = re.escape(name) + "|" if re.fullmatch(r"[A-Za-z0-9_-]+", name) else ""
    return rf"(?:{bare}\"{re.escape(name)}\"|'{re.escape(name)}')"


def table_span(text: str, tenant: str) -> tuple[int, int] | None:
    """Where ``[tenants.<tenant>]`` is written: (its header line's start, the next header's
    start or the end of the text); None if it is not written as a table of its own."""
    name = rf"tenants[ \t]*\.[ \t]*{quoted_key(tenant)}"
    header = re.compile(rf"^[ \t]*\[[ \t]*{name}[ \t]*\][ \t]*(?:#.*)?\r?$", re.M).search(text)
    if header is None:
        return None
    following = re.compile(r"^[ \t]*\[", re.M).search(text, header.end())
    return header.start(), following.start() if following else len(text)


def field_match(text: str, span: tuple[int, int], field: str) -> re.Match[str] | None:
    """The ``field =`` (and the blanks after it) that starts a line within ``span``."""
    return re.compile(rf"^[ \t]*{quoted_key(field)}[ \t]*=[ \t]*", re.M).search(text, *span)


def line_of(text: str, tenant: str, field: str | None = None) -> int | None:
    """The line of a tenant's field (else of its table's header), where it can be found."""
    span = table_span(text, tenant)
    if span is None:  # an inline table or dotted keys: where the tenant's name starts a line
        return top_line(text, rf"(?:tenants[ \t]*\.[ \t]*)?{quoted_key(tenant)}[ \t]*[=.]")
    found = field_match(text, span, field) if field else None
    return _line(text, found.start() if found else span[0])


def top_line(text: str, pattern: str) -> int | None:
    """The first line that starts with ``pattern`` (a regex; after blanks and any ``[``)."""
    found = re.compile(rf"^[ \t]*\[*[ \t]*{pattern}", re.M).search(text)
    return _line(text, found.start()) if found else None


def toml_error_at(message: str, text: str) -> tuple[str, int | None]:
    """tomllib's "reason (at line L, column C)" as ("reason (column C)", L)."""
    m = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", message, re.S)
    if m:
        return f"{m[1]} (column {m[3]})", int(m[2])
    if message.endswith(" (at end of document)"):
        return message.removesuffix(" (at end of document)") + " at the end", _line(text, len(text))
    return message, None


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


@dataclass(frozen=True)
class _Item:
    start: int  # the string's opening quote
    end: int  # just past its closing quote
    value: str


@dataclass(frozen=True)
class _Array:
    open: int  # its "["
    close: int  # its "]"
    items: list[_Item]


def add_key_hash(text: str, tenant: str, key_hash: str) -> str:
    """``text`` with ``key_hash`` last in ``tenant``'s keys (a ``keys`` line made if none)."""
    span, array = _keys_array(text, tenant)
    entry = f'"{key_hash}"'
    if array is None:  # a line of its own, just under the table's header
        eol = text.find("\n", span[0])
        if eol < 0:  # the header is the last line
            return f"{text}\nkeys = [{entry}]\n"
        newline = "\r\n" if text[eol - 1 : eol] == "\r" else "\n"
        return _splice(text, eol + 1, eol + 1, f"keys = [{entry}]{newline}")
    items, close_line = array.items, _line_start(text, array.close)
    if "\n" not in text[array.open : array.close] or text[close_line : array.close].strip():
        if items:  # one line, or "]" after the last key: right after that key
            return _splice(text, items[-1].end, items[-1].end, f", {entry}")
        return _splice(text, array.open + 1, array.close, entry)  # "[]" or "[ ]"
    # one key a line and "]" alone on its line: a line of its own above the "]"
    newline = "\r\n" if text[close_line - 2 : close_line] == "\r\n" else "\n"
    indent = _indent(text, items[-1].start) if items else _indent(text, array.open) + "    "
    text = _splice(text, close_line, close_line, f"{indent}{entry},{newline}")
    if items and text[_skip(text, items[-1].end)] != ",":
        text = _splice(text, items[-1].end, items[-1].end, ",")
    return text


def remove_key_hash(text: str, tenant: str, key_hash: str) -> str:
    """``text`` without ``key_hash`` in ``tenant``'s keys: its line goes too where it had one
    of its own (with its comment), else the key and one comma."""
    _, array = _keys_array(text, tenant)
    found = [i for i, item in enumerate(array.items if array else []) if item.value == key_hash]
    if array is None or not found:
        raise EditError(f"tenant {tenant!r} has no key {key_hash} in its keys array")
    index = found[0]
    item = array.items[index]
    start, eol = _line_start(text, item.start), text.find("\n", item.end)
    eol = len(text) if eol < 0 else eol
    if not text[start : item.start].strip() and re.fullmatch(
        r"[ \t]*,?[ \t]*(#.*)?\r?", text[item.end : eol]
    ):
        return _splice(text, start, eol + 1, "")
    after = _skip(text, item.end)
    if text[after] == ",":  # the key, its comma and the blanks after them
        end = after + 1
        while text[end] in " \t":
            end += 1
        return _splice(text, item.start, end, "")
    if index == 0:  # the only key
        return _splice(text, item.start, item.end, "")
    # the last key, without a comma after it: the comma before it goes, and the blanks
    comma = _skip(text, array.items[index - 1].end)
    start = item.start
    while text[start - 1] in " \t":
        start -= 1
    text = _splice(text, start, item.end, "")
    return _splice(text, comma, comma + 1, "")


def _skip(text: str, offset: int) -> int:
    """The first offset from ``offset`` on that is neither blank nor in a comment."""
    while offset < len(text):
        if text[offset] == "#":
            offset = text.find("\n", offset)
            if offset < 0:
                return len(text)
        elif not text[offset].isspace():
            return offset
        offset += 1
    return offset


def _indent(text: str, offset: int) -> str:
    """The blanks that open ``offset``'s line."""
    start = _line_start(text, offset)
    return text[start : len(text) - len(text[start:].lstrip(" \t"))]


def _splice(text: str, start: int, end: int | None, new: str) -> str:
    return text[:start] + new + text[start if end is None else end :]


def _line_start(text: str, offset: int) -> int:
    return text.rfind("\n", 0, offset) + 1


def _keys_array(text: str, tenant: str) -> tuple[tuple[int, int], _Array | None]:
    span = table_span(text, tenant)
    if span is None:
        raise EditError(f"tenant {tenant!r} is not written as a [tenants.{tenant}] table")
    found = field_match(text, span, "keys")
    return span, None if found is None else _scan_array(text, found.end())


def _scan_array(text: str, start: int) -> _Array:
    """The strings of the one-level array of strings that opens at ``start``."""
    if text[start : start + 1] != "[":
        raise EditError("keys is not written as an array [...]")
    items: list[_Item] = []
    i = start + 1
    while i < len(text):
        c = text[i]
        if c == "]":
            return _Array(start, i, items)
        if c == "#":
            i = text.find("\n", i)
            if i < 0:
                break
        elif c in "\"'":
            if text.startswith(c * 3, i):
                raise EditError("keys holds a multi-line string")
            end = _string_end(text, i)
            items.append(_Item(i, end, tomllib.loads(f"v = {text[i:end]}")["v"]))
            i = end
            continue
        elif c == "[":
            raise EditError("keys holds an array")
        i += 1
    raise EditError("keys has no closing ]")


def _string_end(text: str, start: int) -> int:
    """Just past the one-line string whose quote is at ``start``."""
    quote, i = text[start], start + 1
    while i < len(text) and text[i] != "\n":
        if text[i] == "\\" and quote == '"':
            i += 2
            continue
        if text[i] == quote:
            return i + 1
        i += 1
    raise EditError("keys holds an unterminated string")
