"""Token-length distributions of a workload (``fixed``, ``uniform``, ``lognormal``) and the
checks every part of a workload spec runs on its fields.

A spec's error names its field's whole path (``workload.bursts[0].prompt.mean: must be > 0,
got -3``): each dataclass raises a ``SpecError`` naming its own field, and whoever builds it
inside ``at(path)`` puts the path in front.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any  # a spec read from JSON: values of every type until checked

import numpy as np
import numpy.typing as npt

MAX_TOKENS = 10_000_000  # a prompt or an output, tokens
MAX_SIGMA = 4.0  # a lognormal's sigma: beyond it the clamp, not the distribution, decides
DISTS = ("fixed", "uniform", "lognormal")

Lengths = npt.NDArray[np.int64]


class SpecError(ValueError):
    """A bad field: ``field`` is its path (``prompt.mean``), ``message`` what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


@contextmanager
def at(path: str) -> Iterator[None]:
    """Errors raised inside name their field under ``path``."""
    try:
        yield
    except SpecError as e:
        raise SpecError(f"{path}.{e.field}" if e.field else path, e.message) from None


def check_int(value: object, field: str, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise SpecError(field, f"must be >= {low}, got {value}")
    if value > high:
        raise SpecError(field, f"must be <= {high:g}, got {value}")


def check_number(
    value: object, field: str, high: float, low: float = 0.0, open_low: bool = True
) -> None:
    """A finite number in (low, high] (``open_low``) or [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(field, f"must be a finite number, got {value!r}")
    if value < low or (open_low and value == low):
        raise SpecError(field, f"must be {'>' if open_low else '>='} {low:g}, got {value:g}")
    if value > high:
        raise SpecError(field, f"must be <= {high:g}, got {value:g}")


@dataclass(frozen=True)
class Fixed:
    value: int

    def __post_init__(self) -> None:
        check_int(self.value, "value", 1, MAX_TOKENS)

    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        return np.full(n, self.value, dtype=np.int64)

    def expected(self) -> float:
        return float(self.value)

    def largest(self) -> int:
        return self.value

    def describe(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Uniform:
    """Integers in [low, high], both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        check_int(self.low, "low", 1, MAX_TOKENS)
        check_int(self.high, "high", self.low, MAX_TOKENS)

    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)

    def expected(self) -> float:
        return (self.low + self.high) / 2

    def largest(self) -> int:
        return self.high

    def describe(self) -> str:
        return f"uniform:{self.low}:{self.high}"


@dataclass(frozen=True)
class LogNormal:
    """A lognormal of mean ``mean`` (mu = ln(mean) − sigma²/2, so E[X] is ``mean`` itself),
    rounded and clamped to [1, ``max``]; ``expected()`` is the clamped distribution's mean."""

    mean: float
    sigma: float
    max: int

    def __post_init__(self) -> None:
        check_number(self.mean, "mean", MAX_TOKENS, low=1.0, open_low=False)
        check_number(self.sigma, "sigma", MAX_SIGMA, open_low=False)
        check_int(self.max, "max", math.ceil(self.mean), MAX_TOKENS)

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma**2 / 2

    def sample(self, rng: np.random.Generator, n: int) -> Lengths:
        drawn = np.rint(rng.lognormal(self.mu, self.sigma, size=n))
        return np.clip(drawn, 1, self.max).astype(np.int64)

    def expected(self) -> float:
        """E[clamp(X, 1, max)] = P(X < 1) + E[X; 1 <= X <= max] + max · P(X > max)."""
        if self.sigma == 0:
            return float(self.mean)
        s, mu = self.sigma, self.mu

        def cdf(x: float) -> float:  # the standard normal's
            return 0.5 * (1 + math.erf(x / math.sqrt(2)))

        hi = math.log(self.max)
        inside = self.mean * (cdf((hi - mu - s * s) / s) - cdf((-mu - s * s) / s))
        return cdf(-mu / s) + inside + self.max * (1 - cdf((hi - mu) / s))

    def largest(self) -> int:
        return self.max

    def describe(self) -> str:
        return f"lognormal:{self.mean:g}:{self.sigma:g}:{self.max}"


Dist = Fixed | Uniform | LogNormal

_FIELDS = {"fixed": ("value",), "uniform": ("low", "high"), "lognormal": ("mean", "sigma", "max")}


def check_dist(value: object, field: str) -> None:
    if not isinstance(value, Fixed | Uniform | LogNormal):
        raise SpecError(field, f"must be a length distribution, got {value!r}")


def number(text: str) -> int | float | str:
    """``"12"`` → 12, ``"1.5"`` → 1.5; anything else stays a string (for the field's check to
    name)."""
    text = text.strip()
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_dist(value: Any) -> Dist:
    """A length distribution from JSON: ``{"dist": "uniform", "low": 32, "high": 128}``, a
    plain integer (fixed) or a compact string: ``N``, ``fixed:N``, ``uniform:LOW:HIGH``,
    ``lognormal:MEAN:SIGMA:MAX``. Errors name the field under the caller's ``at``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Fixed(value)
    if isinstance(value, str):
        name, *args = value.split(":")
        if not args:
            name, args = "fixed", [name]
        if name not in _FIELDS:
            raise SpecError(
                "", f"unknown distribution {name!r} in {value!r} (one of {', '.join(DISTS)})"
            )
        if len(args) != len(_FIELDS[name]):
            form = ":".join([name, *(f.upper() for f in _FIELDS[name])])
            raise SpecError("", f"{value!r}: expected {form}")
        value = {"dist": name, **dict(zip(_FIELDS[name], map(number, args), strict=True))}
    if not isinstance(value, dict):
        raise SpecError("", f"must be an object, an integer or a string, got {value!r}")
    kind = value.get("dist")
    if kind not in _FIELDS:
        raise SpecError("dist", f"must be one of {', '.join(DISTS)}, got {kind!r}")
    fields = {k: v for k, v in value.items() if k != "dist"}
    check_keys(fields, required=_FIELDS[kind])
    if kind == "fixed":
        return Fixed(**fields)
    if kind == "uniform":
        return Uniform(**fields)
    return LogNormal(**fields)


def check_keys(
    data: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()
) -> None:
    for key in data:
        if key not in required + optional:
            raise SpecError(str(key), f"unknown field (known: {', '.join(required + optional)})")
    for key in required:
        if key not in data:
            raise SpecError(key, "required")
