"""A model's measured speed on one machine: what the planner sizes the pools with.

``pdserve profile`` (launch/profile.py) measures it; this module holds the figures, reads
and writes them as JSON (validated and bounded: a profile file is input like any other), and
answers for sizes that were not measured. Torch-free, no I/O but ``load``/``save``.

A profile may instead be derived, for hardware not measured here, from a model's shape and
a device's figures by a roofline (sim/derive.py): its ``derived`` field then says how, with
every efficiency factor (``is_derived``: what shows a profile marks a derived one so).

A profile is of one worker as the planner counts them: a tensor-parallel group of
``tensor_parallel_size`` ranks (engine/tp/) is one worker, measured whole (a file without the
field, as written before groups, is of one rank). The planner sizes each pool with the
profile at the size its workers run at (coordinator/planner.py).

    prefill_seconds(n)        piecewise linear in prompt tokens through the measured points;
                              below the first point its segment's line (floored at 0), past
                              the last the last segment's per-token slope (at least the last
                              point's mean per-token time: prefill is never cheaper per token
                              as prompts grow, whatever the timing noise)
    decode_step_seconds(b, c) bilinear: piecewise linear in batch within each measured
                              context (the last two batches' slope past the last, flat with one),
                              then linear in context between the two nearest measured contexts,
                              the nearest one's value below the first, the last two's slope
                              (>= 0) past the last
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from pdserve.protocol.control import MAX_TENSOR_PARALLEL_SIZE

VERSION = 1
MAX_FILE_BYTES = 1 << 20
MAX_POINTS = 1024
MAX_TOKENS = 1 << 24  # prompt or context tokens in one point
MAX_BATCH = 1 << 16
MAX_SECONDS = 1e5
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# "cpu", "cuda:0", and the devices a derived profile names ("h100", "l40s")
_DEVICE = re.compile(r"[a-z][a-z0-9]{0,15}(:[0-9]{1,3})?")
MAX_DERIVED_CHARS = 1000


@dataclass(frozen=True)
class Profile:
    """One worker of ``model`` as measured: prefill time by prompt length, decode step time by
    batch and context, and its KV capacity; a worker of ``tensor_parallel_size`` ranks."""

    model: str  # served name, e.g. "smollm2-135m-instruct"
    device: str  # "cpu" / "cuda"
    threads: int  # torch threads of the worker measured
    block_size: int
    kv_blocks: int  # KV capacity (blocks) of one worker as measured
    prefill: tuple[tuple[int, float], ...]  # (prompt_tokens, seconds for the whole prefill)
    decode: tuple[tuple[int, int, float], ...]  # (batch, context_tokens, seconds per step)
    tensor_parallel_size: int = 1  # ranks of the worker measured (a tensor-parallel group)
    # "" when measured; else one line saying how it was derived ("roofline: h100 x8, ...")
    derived: str = ""

    def __post_init__(self) -> None:
        _check_name(self.model, "model", _NAME)
        _check_name(self.device, "device", _DEVICE)
        _check_int(self.threads, "threads", 1, 1 << 12)
        _check_int(self.block_size, "block_size", 1, 1 << 12)
        _check_int(self.kv_blocks, "kv_blocks", 1, 1 << 30)
        _check_int(self.tensor_parallel_size, "tensor_parallel_size", 1, MAX_TENSOR_PARALLEL_SIZE)
        _check_derived(self.derived)
        _check_points(self.prefill, "prefill", 2, MAX_POINTS)
        _check_points(self.decode, "decode", 3, MAX_POINTS)
        tokens = [n for n, _ in self.prefill]
        if any(b <= a for a, b in itertools.pairwise(tokens)):
            raise ValueError("profile prefill: prompt lengths must be strictly increasing")
        for n, t in self.prefill:
            _check_int(n, "prefill prompt_tokens", 1, MAX_TOKENS)
            _check_seconds(t, "prefill")
        for b, c, t in self.decode:
            _check_int(b, "decode batch", 1, MAX_BATCH)
            _check_int(c, "decode context_tokens", 0, MAX_TOKENS)
            _check_seconds(t, "decode")
        if len({(b, c) for b, c, _ in self.decode}) != len(self.decode):
            raise ValueError("profile decode: a (batch, context) point appears twice")

    @property
    def is_derived(self) -> bool:
        """Whether the figures were derived (sim/derive.py) rather than measured."""
        return bool(self.derived)

    # ---- answers --------------------------------------------------------------------------
    def prefill_seconds(self, prompt_tokens: int) -> float:
        """Seconds one worker takes to prefill a prompt of ``prompt_tokens`` (0 for none)."""
        if prompt_tokens <= 0:
            return 0.0
        pts = self.prefill
        if len(pts) == 1:
            n0, t0 = pts[0]
            return t0 * prompt_tokens / n0
        n_last, t_last = pts[-1]
        if prompt_tokens > n_last:
            n_prev, t_prev = pts[-2]
            slope = max((t_last - t_prev) / (n_last - n_prev), t_last / n_last)
            return t_last + slope * (prompt_tokens - n_last)
        line = [(float(n), t) for n, t in pts]
        return max(0.0, _interp(line, prompt_tokens))

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """Seconds one decode step of ``batch`` sequences of ``context`` tokens each takes."""
        batch, context = max(1, batch), max(0, context)
        rows: dict[int, list[tuple[float, float]]] = {}
        for b, c, t in sorted(self.decode):
            rows.setdefault(c, []).append((float(b), t))
        by_context = [(float(c), _batch_line(rows[c], batch)) for c in sorted(rows)]
        if len(by_context) == 1 or context <= by_context[0][0]:
            return by_context[0][1]
        return _interp(by_context, context)

    # ---- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The JSON fields; ``derived`` only when the profile is derived (measured files stay as
        they were written before the field)."""
        return {
            "version": VERSION,
            "model": self.model,
            "device": self.device,
            **({"derived": self.derived} if self.derived else {}),
            "threads": self.threads,
            "tensor_parallel_size": self.tensor_parallel_size,
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks,
            "prefill": [[n, t] for n, t in self.prefill],
            "decode": [[b, c, t] for b, c, t in self.decode],
        }

    @classmethod
    def from_json(cls, data: Any) -> Profile:
        """A profile from parsed JSON; ``ValueError`` saying what is wrong otherwise."""
        if not isinstance(data, dict):
            raise ValueError("a profile must be a JSON object")
        fields = {"version", *cls.__dataclass_fields__}
        unknown = sorted(set(data) - fields)
        # a file written before profiles had a tensor-parallel size is of one rank; one
        # without ``derived`` was measured
        missing = sorted(fields - set(data) - {"tensor_parallel_size", "derived"})
        if unknown or missing:
            raise ValueError(f"profile: unknown fields {unknown}, missing fields {missing}")
        if data["version"] != VERSION or isinstance(data["version"], bool):
            raise ValueError(f"profile: version {data['version']!r} is not {VERSION}")
        for key in ("prefill", "decode"):
            if not isinstance(data[key], list) or len(data[key]) > MAX_POINTS:
                raise ValueError(f"profile {key}: a list of at most {MAX_POINTS} points")
        return cls(
            model=data["model"],
            device=data["device"],
            threads=data["threads"],
            block_size=data["block_size"],
            kv_blocks=data["kv_blocks"],
            tensor_parallel_size=data.get("tensor_parallel_size", 1),
            derived=data.get("derived", ""),
            prefill=tuple(_tuple(p, "prefill", 2) for p in data["prefill"]),
            decode=tuple(_tuple(p, "decode", 3) for p in data["decode"]),
        )

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile file; ``ValueError`` (naming the file) if it is not a valid one."""
        path = Path(path)
        try:
            return cls.from_json(json.loads(read_bounded(path, MAX_FILE_BYTES).decode("utf-8")))
        except (UnicodeDecodeError, RecursionError, ValueError) as e:
            raise ValueError(f"profile {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write the JSON, one point a line."""
        fields = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in self.to_json().items()]
        for key in ("prefill", "decode"):
            i = next(i for i, f in enumerate(fields) if f.startswith(f' "{key}"'))
            points = ",\n  ".join(json.dumps(p) for p in getattr(self, key))
            fields[i] = f' "{key}": [\n  {points}\n ]'
        Path(path).write_text("{\n" + ",\n".join(fields) + "\n}\n", encoding="utf-8")


def read_bounded(path: str | Path, max_bytes: int) -> bytes:
    """A file's bytes, at most ``max_bytes`` of them; ``ValueError`` (not naming the file: the
    caller does) when it cannot be read or is larger."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(e.strerror or str(e)) from None
    if len(raw) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    return raw


def shipped_profile(model: str) -> Profile | None:
    """The profile shipped for ``model`` (``models/profiles/<model>.json``), if there is one;
    each is of one rank (no ``tensor_parallel_size`` in the file: 1)."""
    if not _NAME.fullmatch(model):
        return None
    file = resources.files("pdserve.models").joinpath("profiles", f"{model}.json")
    if not file.is_file():
        return None
    with resources.as_file(file) as path:
        return Profile.load(path)


# ---- interpolation ---------------------------------------------------------------------------


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through ``pts`` (x increasing, two at least); outside them the end
    segment's line, its slope floored at 0 (more work never takes less time)."""
    i = 1
    while i < len(pts) - 1 and x > pts[i][0]:
        i += 1
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    slope = (y1 - y0) / (x1 - x0)
    if x > x1:
        return y1 + max(slope, 0.0) * (x - x1)
    if x < x0:
        return y0 + max(slope, 0.0) * (x - x0)
    return y0 + slope * (x - x0)


def _batch_line(row: list[tuple[float, float]], batch: int) -> float:
    """One context's step time at ``batch``: flat with one point, else linear; never below the
    smallest measured step (a batch smaller than measured is no cheaper than one sequence)."""
    if len(row) == 1:
        return row[0][1]
    value = _interp(row, batch)
    return max(value, min(t for _, t in row)) if batch < row[0][0] else value


# ---- validation ------------------------------------------------------------------------------


def _tuple(point: Any, key: str, size: int) -> tuple[Any, ...]:
    if not isinstance(point, list) or len(point) != size:
        raise ValueError(f"profile {key}: each point is a list of {size} numbers, got {point!r}")
    return tuple(point)


def _check_name(value: Any, key: str, pattern: re.Pattern[str]) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"profile {key}: {str(value)[:40]!r} is not a valid {key}")


def _check_int(value: Any, key: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"profile {key}: {value!r} is not an integer in [{low}, {high}]")


def _check_derived(value: Any) -> None:
    if not isinstance(value, str) or len(value) > MAX_DERIVED_CHARS or not value.isprintable():
        raise ValueError(
            f"profile derived: one printable line of at most {MAX_DERIVED_CHARS} characters, "
            f"got {str(value)[:40]!r}"
        )


def _check_seconds(value: Any, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"profile {key}: seconds must be a number, got {value!r}")
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise ValueError(f"profile {key}: {value!r} seconds is not in (0, {MAX_SECONDS:g}]")


def _check_points(points: Any, key: str, size: int, most: int) -> None:
    if not isinstance(points, tuple) or not 1 <= len(points) <= most:
        raise ValueError(f"profile {key}: 1 to {most} points")
    if any(not isinstance(p, tuple) or len(p) != size for p in points):
        raise ValueError(f"profile {key}: each point has {size} fields")
