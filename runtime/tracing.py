"""Distributed traces of a request: a W3C ``traceparent`` travels with it, each role adds its
span, and a role given ``--otlp-endpoint`` exports its spans over OTLP/HTTP (runtime/otlp.py)::

    client ─traceparent─▶ gateway span ──Generate.trace──▶ coordinator span
                              (the request)                 (routing, the wait for blocks)
                                            ──Reserve.trace, PrefillJob.trace──▶ prefill span
                                                                                 decode span

The gateway takes the HTTP request's ``traceparent`` (checked strictly: anything else starts a
new trace, never a 4xx) or starts a trace; each role's span is a child of the context it was
handed, and the coordinator hands on its own (its span id derived from the context and the
choice, so the ``Reserve`` it sends before its span ends names it without any state kept).

Off (no ``--otlp-endpoint``: ``NO_TRACER``) nothing is imported, no span is built, and a
context is passed on unchanged; the gateway starts none, so the wire carries an empty string.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from urllib.parse import urlsplit

TRACEPARENT = "traceparent"  # the HTTP header (W3C Trace Context)
TRACEPARENT_LEN = 55  # "00-" 32 hex "-" 16 hex "-" 2 hex
_HEX = frozenset("0123456789abcdef")

Attributes = Mapping[str, str | int | float | bool]


class SpanKind(IntEnum):
    """OTLP's ``Span.SpanKind``."""

    INTERNAL = 1
    SERVER = 2


@dataclass(frozen=True)
class TraceContext:
    """A trace id and the span a receiver's span is a child of (``span_id``)."""

    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero
    flags: int = 1  # bit 0: sampled

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    def with_span(self, span_id: str) -> TraceContext:
        return TraceContext(self.trace_id, span_id, self.flags)


def parse_traceparent(value: str | None) -> TraceContext | None:
    """The context of a version-00 ``traceparent``; None for anything else (another length,
    version or separator, upper-case or non-hex digits, an all-zero id)."""
    if value is None or len(value) != TRACEPARENT_LEN:
        return None
    version, trace_id, span_id, flags = value[:2], value[3:35], value[36:52], value[53:]
    if value[2] != "-" or value[35] != "-" or value[52] != "-" or version != "00":
        return None
    if not _HEX.issuperset(trace_id + span_id + flags):
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceContext(trace_id, span_id, int(flags, 16))


def new_trace() -> TraceContext:
    """A new sampled trace; ``span_id`` is its first span's (the gateway's)."""
    return TraceContext(_nonzero(16), _nonzero(8))


def new_span_id() -> str:
    return _nonzero(8)


def derived_span_id(parent: TraceContext, salt: str) -> str:
    """A span id that is the same for the same parent and salt (the coordinator's)."""
    digest = hashlib.blake2b(f"{parent.header()} {salt}".encode(), digest_size=8).hexdigest()
    return digest if digest != "0" * 16 else "0" * 15 + "1"


def _nonzero(nbytes: int) -> str:
    while (value := secrets.token_hex(nbytes)) == "0" * (2 * nbytes):
        pass
    return value


class Tracer:
    """One role's spans. This one is off: it builds and exports nothing, and ``child`` passes a
    context on as it came, so the roles that do export still share the trace. The one that
    exports (``runtime.otlp.OtlpTracer``) overrides ``enabled``, ``record`` and ``close``."""

    enabled = False

    def child(self, parent: str, salt: str) -> str:
        """The context to hand on under this role's span of ``salt`` (``span`` with the same
        ``salt`` records that span)."""
        if not self.enabled or not parent:
            return parent
        ctx = parse_traceparent(parent)
        return "" if ctx is None else ctx.with_span(derived_span_id(ctx, salt)).header()

    def span(
        self,
        name: str,
        parent: str,
        start: float,
        end: float,
        attributes: Attributes,
        *,
        salt: str | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> None:
        """A span from ``start`` to ``end`` (``time.monotonic()``) under the context ``parent``
        (none when it is empty, malformed or not sampled); ``salt``: the one ``child`` was
        given, so the span has the id handed on."""
        if not self.enabled:
            return
        ctx = parse_traceparent(parent)
        if ctx is None or not ctx.sampled:
            return
        span_id = new_span_id() if salt is None else derived_span_id(ctx, salt)
        self.record(ctx.trace_id, span_id, ctx.span_id, name, start, end, attributes, kind)

    def record(
        self,
        trace_id: str,
        span_id: str,
        parent_span_id: str,
        name: str,
        start: float,
        end: float,
        attributes: Attributes,
        kind: SpanKind,
    ) -> None:
        """Export one span (``parent_span_id`` "" for a trace's root)."""

    def close(self) -> None:
        """Send what is queued (within a bound) and stop."""


NO_TRACER = Tracer()


def otlp_endpoint(text: str) -> str:
    """``--otlp-endpoint``: a collector's OTLP/HTTP base URL (``http://host:4318``) or its
    traces URL; returns the traces URL (``…/v1/traces``)."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"an http:// or https:// URL, not {text!r}")
    try:
        parts.port  # noqa: B018 (a malformed port raises here)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    path = parts.path.rstrip("/")
    return text if path.endswith("/v1/traces") else f"{text.rstrip('/')}/v1/traces"


def add_otlp_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--otlp-endpoint",
        type=otlp_endpoint,
        default=None,
        metavar="URL",
        help="export this role's trace spans over OTLP/HTTP (protobuf) to a collector, e.g. "
        "http://127.0.0.1:4318 (default: off, no spans built)",
    )


def otlp_flags(args: argparse.Namespace) -> list[str]:
    """``--otlp-endpoint`` as ``pdserve serve`` passes it on to each role it starts."""
    endpoint = getattr(args, "otlp_endpoint", None)
    return [f"--otlp-endpoint={endpoint}"] if endpoint else []


def tracer_from_args(args: argparse.Namespace, service: str) -> Tracer:
    """The role's tracer: off without ``--otlp-endpoint`` (the exporter is not imported)."""
    endpoint = getattr(args, "otlp_endpoint", None)
    if not endpoint:
        return NO_TRACER
    from pdserve.runtime.otlp import OtlpTracer

    return OtlpTracer(endpoint, service)
