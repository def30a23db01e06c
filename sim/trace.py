"""Recorded workloads: a CSV trace, or a bench result saved with ``pdserve bench
--save-detailed`` (bench/metrics.py ``detail()``), replayed request by request.

CSV: a header, then one row per request::

    arrival_s,prompt_tokens,output_tokens,prefix_id,prefix_tokens,tier
    0.0,300,40,chat7,,0          ← a session's turn 1: key chat7/t1
    2.5,400,40,chat7,,0          ← turn 2: its prefix is turn 1's prompt + output (340 tokens)
    3.1,2000,10,doc3,1800,1      ← prefix_tokens: doc3's first 1800 tokens, shared by its rows

The last three columns are optional. Rows with one ``prefix_id`` and no ``prefix_tokens`` are
the turns of one conversation, in arrival order: each row names the previous row's prompt
plus output as its prefix (``(id/tK-1, tokens)``) and is cached as ``id/tK``. With
``prefix_tokens`` (the same on every row of that id) they share that many tokens
instead: a system prompt or a document. Rows are counted from 1 after the header.

Arrivals are sorted and made relative to the first (a trace of unix times starts at 0). Bench
results: ``start_times`` are seconds from the run's start, in send order; a failed request
(output 0) is left out and counted: ``detail()`` keeps its measured lengths only, not the
``max_tokens`` it asked for. The bench records no conversation of a turn, so a multi-turn
run replays without prefixes (its ``kinds`` stay).
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass, replace
from typing import Any  # a bench result is JSON: lists of values of every type until checked

from pdserve.sim.request import SimRequest

MAX_REQUESTS = 5_000_000  # what one simulation takes, generated or read
MAX_FILE_BYTES = 256 * 2**20
REQUIRED = ("arrival_s", "prompt_tokens", "output_tokens")
OPTIONAL = ("prefix_id", "prefix_tokens", "tier")


@dataclass(frozen=True)
class Trace:
    """``units[i]``: which requests are kept or left out together when thinned (a
    conversation's turns share one); ``skipped``: failed requests left out of a bench run."""

    source: str
    items: tuple[SimRequest, ...]
    units: tuple[int, ...]
    sessions: int = 0
    skipped: int = 0

    def requests(self, seed: int | None = None) -> list[SimRequest]:
        """The trace's requests (``seed`` is for generated workloads: a trace has no draw)."""
        return list(self.items)

    def span_s(self) -> float:
        return self.items[-1].arrival_s - self.items[0].arrival_s

    def request_rate(self) -> float:
        """Requests over the span of arrivals; ``inf`` when they all arrive at once."""
        return len(self.items) / self.span_s() if self.span_s() > 0 else math.inf

    def mean_prompt_tokens(self) -> float:
        return sum(r.prompt_tokens for r in self.items) / len(self.items)

    def mean_output_tokens(self) -> float:
        return sum(r.output_tokens for r in self.items) / len(self.items)

    def describe(self) -> str:
        text = (
            f"trace {os.path.basename(self.source)}: {len(self.items)} requests over "
            f"{self.span_s():.4g} s, prompt {self.mean_prompt_tokens():.0f} and output "
            f"{self.mean_output_tokens():.0f} tokens on average"
        )
        if self.sessions:
            text += f", {self.sessions} sessions"
        if self.skipped:
            text += f", {self.skipped} failed requests left out"
        return text

    def scaled(self, fraction: float) -> Trace:
        """A slice: the units (a request, or a conversation's turns together) whose rank k in
        order of first arrival has ``ceil((k + 1)·f) > ceil(k·f)``: an evenly spread
        ``fraction`` of them, the first always, the same on every call, arrivals as they
        were."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        rank: dict[int, int] = {}
        for unit in self.units:
            rank.setdefault(unit, len(rank))
        keep = {
            u for u, k in rank.items() if math.ceil((k + 1) * fraction) > math.ceil(k * fraction)
        }
        pairs = [(r, u) for r, u in zip(self.items, self.units, strict=True) if u in keep]
        items, units = zip(*pairs, strict=True)
        return replace(self, items=items, units=units)


@dataclass(frozen=True)
class _Row:
    row: int
    arrival_s: float
    prompt: int
    output: int
    prefix_id: str
    prefix_tokens: int | None
    tier: int


def read_text(path: str) -> str:
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than the {MAX_FILE_BYTES >> 20} MiB allowed")
    try:
        with open(path, encoding="utf-8-sig") as f:  # a spreadsheet's byte-order mark: not text
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_csv_trace(path: str) -> Trace:
    name = os.path.basename(path)
    reader = csv.reader(io.StringIO(read_text(path)))
    header = [h.strip() for h in next(reader, [])]
    wanted = ",".join(REQUIRED) + "[," + ",".join(OPTIONAL) + "]"
    if not set(REQUIRED) <= set(header):
        raise ValueError(f"{name}: the header must name {wanted}, got {','.join(header)!r}")
    unknown = [h for h in header if h not in REQUIRED + OPTIONAL] + sorted(
        {h for h in header if header.count(h) > 1}
    )
    if unknown:
        raise ValueError(f"{name}: unknown or repeated columns {unknown} (expected {wanted})")
    rows = []
    for number, fields in enumerate(reader, 1):
        if not any(f.strip() for f in fields):
            continue
        if len(fields) != len(header):
            raise ValueError(f"{name} row {number}: {len(fields)} fields, expected {len(header)}")
        rows.append(
            _csv_row(f"{name} row {number}", number, dict(zip(header, fields, strict=True)))
        )
        if len(rows) > MAX_REQUESTS:
            raise ValueError(f"{name}: more than {MAX_REQUESTS} rows")
    if not rows:
        raise ValueError(f"{name}: no rows")
    rows.sort(key=lambda r: r.arrival_s)
    return _sessions(name, path, rows)


def _csv_row(where: str, number: int, values: dict[str, str]) -> _Row:
    def integer(column: str, low: int, default: int | None = None) -> int:
        text = values.get(column, "").strip()
        if not text and default is not None:
            return default
        if not (text.isascii() and text.isdigit()) or int(text) < low:
            kind = "a positive integer" if low else "an integer >= 0"
            raise ValueError(f"{where}: {column} must be {kind}, got {text!r}")
        return int(text)

    try:
        arrival = float(values["arrival_s"])
    except ValueError:
        arrival = math.nan
    if not (math.isfinite(arrival) and arrival >= 0):
        raise ValueError(f"{where}: arrival_s must be a number >= 0, got {values['arrival_s']!r}")
    prompt, output = integer("prompt_tokens", 1), integer("output_tokens", 1)
    prefix_id = values.get("prefix_id", "").strip()
    shared = integer("prefix_tokens", 1, default=0) or None
    if shared is not None and (not prefix_id or shared > prompt):
        raise ValueError(
            f"{where}: prefix_tokens {shared} needs a prefix_id and at most prompt_tokens "
            f"({prompt})"
        )
    return _Row(number, arrival, prompt, output, prefix_id, shared, integer("tier", 0, default=0))


def _sessions(name: str, path: str, rows: list[_Row]) -> Trace:
    """Rows (in arrival order) → requests: a conversation's turns chained, shared prefixes
    named."""
    first = rows[0].arrival_s
    shared: dict[str, int | None] = {}  # prefix_id → its prefix_tokens (None: a conversation)
    history: dict[str, tuple[int, int]] = {}  # conversation → (turns so far, last prompt+output)
    unit_of: dict[str, int] = {}  # conversation → its unit
    items, units = [], []
    for index, row in enumerate(rows):
        prefixes: tuple[tuple[str, int], ...] = ()
        key, unit = None, index + len(rows)  # a row of its own: a unit no conversation has
        if row.prefix_id:
            mode = shared.setdefault(row.prefix_id, row.prefix_tokens)
            if mode != row.prefix_tokens:
                raise ValueError(
                    f"{name} row {row.row}: prefix_tokens {row.prefix_tokens} where earlier "
                    f"rows of {row.prefix_id!r} have {mode}: one value per prefix_id"
                )
            if mode is not None:
                prefixes = ((row.prefix_id, mode),)
            else:
                turns, before = history.get(row.prefix_id, (0, 0))
                if before > row.prompt:
                    raise ValueError(
                        f"{name} row {row.row}: prompt_tokens {row.prompt} is shorter than "
                        f"{row.prefix_id!r}'s previous turn (prompt + output = {before})"
                    )
                if turns:
                    prefixes = ((f"{row.prefix_id}/t{turns}", before),)
                key = f"{row.prefix_id}/t{turns + 1}"
                history[row.prefix_id] = (turns + 1, row.prompt + row.output)
                unit = unit_of.setdefault(row.prefix_id, len(unit_of))
        items.append(
            SimRequest(
                row.arrival_s - first,
                row.prompt,
                row.output,
                prefixes=prefixes,
                key=key,
                tier=row.tier,
                kind="trace",
            )
        )
        units.append(unit)
    return Trace(path, tuple(items), tuple(units), sessions=len(history))


def bench_trace(data: dict[str, Any], path: str) -> Trace:
    """A ``pdserve bench --save-detailed`` result's requests (one run: its top-level lists)."""
    name = os.path.basename(path)
    lists: dict[str, list[Any]] = {}
    for key in ("input_lens", "output_lens", "start_times", "kinds"):
        value = data.get(key, [""] * len(lists["input_lens"]) if key == "kinds" else None)
        if not isinstance(value, list):
            raise ValueError(f"{name}: {key} must be a list (pdserve bench --save-detailed)")
        lists[key] = value
    if len({len(v) for v in lists.values()}) != 1:
        sizes = {k: len(v) for k, v in lists.items()}
        raise ValueError(f"{name}: the per-request lists differ in length: {sizes}")
    if len(lists["input_lens"]) > MAX_REQUESTS:
        raise ValueError(f"{name}: more than {MAX_REQUESTS} requests")
    kept, skipped = [], 0
    for i, (inp, out, start, kind) in enumerate(zip(*lists.values(), strict=True)):
        where = f"{name} request {i}"
        for field, value in (("input_lens", inp), ("output_lens", out)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {field} must be an integer >= 0, got {value!r}")
        if isinstance(start, bool) or not isinstance(start, int | float) or not start >= 0:
            raise ValueError(f"{where}: start_times must be a number >= 0, got {start!r}")
        if not isinstance(kind, str):
            raise ValueError(f"{where}: kinds must be a string, got {kind!r}")
        if inp == 0 or out == 0:  # failed: its lengths are unknown
            skipped += 1
            continue
        kept.append((float(start), inp, out, kind or "trace"))
    if not kept:
        raise ValueError(f"{name}: no completed request ({skipped} failed)")
    kept.sort(key=lambda k: k[0])
    first = kept[0][0]
    items = tuple(SimRequest(t - first, i, o, kind=k) for t, i, o, k in kept)
    return Trace(path, items, tuple(range(len(items))), skipped=skipped)
