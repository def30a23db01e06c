"""Spans out over OTLP/HTTP: ``POST <endpoint>`` of an ``ExportTraceServiceRequest`` in protobuf
(``Content-Type: application/x-protobuf``), from a thread of its own.

Imported only when a role is given ``--otlp-endpoint`` (runtime/tracing.py). The few messages
a span needs are encoded here by hand (tests decode them with ``opentelemetry-proto``), rather
than through the OpenTelemetry SDK: a role needs no protobuf runtime, no SDK span objects (its
spans are known only once they end, from monotonic durations), and no exporter it cannot bound.

A collector never slows a role down: ``record`` only puts a tuple on a bounded queue (full:
the span is dropped and counted); the thread posts what has queued, a batch at a time, with a
timeout, and after a failure waits (doubling, up to ``MAX_BACKOFF_S``) before the next try,
dropping what cannot wait. ``close`` gives it ``CLOSE_WAIT_S`` to send the rest.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import queue
import struct
import threading
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

from pdserve.runtime.tracing import Attributes, SpanKind, Tracer

log = logging.getLogger(__name__)

MAX_QUEUED = 4096  # spans waiting to be sent; more are dropped
MAX_BATCH = 512  # spans in one request
POST_TIMEOUT_S = 2.0
MAX_BACKOFF_S = 30.0
CLOSE_WAIT_S = 2.0
SCOPE = "pdserve"

# (trace id, span id, parent span id, name, kind, start ns, end ns, attributes)
SpanRecord = tuple[bytes, bytes, bytes, str, int, int, int, tuple[tuple[str, object], ...]]
_STOP: SpanRecord = (b"", b"", b"", "", 0, 0, 0, ())


class OtlpTracer(Tracer):
    """Owns the queue of spans to send and the thread that sends them to ``endpoint``."""

    enabled = True

    def __init__(self, endpoint: str, service: str) -> None:
        self.endpoint = endpoint
        self.service = service
        self.sent = 0
        self.dropped = 0  # queue full, or the collector failed them
        self._queue: queue.Queue[SpanRecord] = queue.Queue(MAX_QUEUED)
        self._resource = resource(service)
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._thread.start()

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
        offset = time.time_ns() - time.monotonic_ns()  # monotonic → Unix time, now
        span = (
            bytes.fromhex(trace_id),
            bytes.fromhex(span_id),
            bytes.fromhex(parent_span_id),
            name,
            int(kind),
            int(start * 1e9) + offset,
            int(max(end, start) * 1e9) + offset,
            tuple(attributes.items()),
        )
        try:
            self._queue.put_nowait(span)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=CLOSE_WAIT_S)
        self._thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        backoff, retry_at = 0.0, 0.0  # after a failure: no post before retry_at (monotonic)
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(s is _STOP for s in batch)
            spans = [s for s in batch if s is not _STOP]
            if spans and (stop or time.monotonic() >= retry_at):
                if self._post(export_request(self._resource, spans)):
                    self.sent += len(spans)
                    backoff = 0.0
                else:
                    self.dropped += len(spans)
                    backoff = min(max(2 * backoff, 0.5), MAX_BACKOFF_S)
                    retry_at = time.monotonic() + backoff
            else:  # the collector failed a moment ago: these are not worth waiting for
                self.dropped += len(spans)
            if stop:
                return

    def _post(self, body: bytes) -> bool:
        url = urlsplit(self.endpoint)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = kind(url.hostname or "", url.port, timeout=POST_TIMEOUT_S)
        try:
            headers = {"Content-Type": "application/x-protobuf"}
            conn.request("POST", url.path or "/v1/traces", body, headers)
            status = conn.getresponse().status
            if 200 <= status < 300:
                return True
            log.warning("OTLP collector at %s answered %d: spans dropped", self.endpoint, status)
        except (OSError, http.client.HTTPException) as e:
            log.warning("OTLP collector at %s: %s: spans dropped", self.endpoint, e)
        finally:
            conn.close()
        return False


# ---- protobuf (opentelemetry/proto/collector/trace/v1, trace/v1, common/v1) -------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64: two's complement
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _any_value(value: object) -> bytes:
    if isinstance(value, bool):
        return _varint(2 << 3) + _varint(int(value))  # bool_value
    if isinstance(value, int):
        return _varint(3 << 3) + _varint(value)  # int_value
    if isinstance(value, float):
        return _varint(4 << 3 | 1) + struct.pack("<d", value)  # double_value
    return _field(1, str(value).encode())  # string_value


def _attributes(number: int, items: Iterable[tuple[str, object]]) -> bytes:
    """Repeated ``KeyValue`` {key = 1, value = 2 (AnyValue)}."""
    return b"".join(
        _field(number, _field(1, key.encode()) + _field(2, _any_value(value)))
        for key, value in items
    )


def resource(service: str) -> bytes:
    """``Resource`` {attributes = 1}: the role as ``service.name``."""
    return _attributes(1, [("service.name", service)])


def _span(s: SpanRecord) -> bytes:
    trace_id, span_id, parent, name, kind, start_ns, end_ns, attributes = s
    return b"".join(
        [
            _field(1, trace_id),
            _field(2, span_id),
            _field(4, parent) if parent else b"",
            _field(5, name.encode()),
            _varint(6 << 3) + _varint(kind),
            _varint(7 << 3 | 1) + struct.pack("<Q", start_ns),  # fixed64
            _varint(8 << 3 | 1) + struct.pack("<Q", end_ns),
            _attributes(9, attributes),
        ]
    )


def export_request(resource_bytes: bytes, spans: list[SpanRecord]) -> bytes:
    """``ExportTraceServiceRequest`` {resource_spans = 1: ResourceSpans {resource = 1,
    scope_spans = 2: ScopeSpans {scope = 1, spans = 2}}}."""
    scope = _field(1, _field(1, SCOPE.encode()))
    scope_spans = scope + b"".join(_field(2, _span(s)) for s in spans)
    return _field(1, _field(1, resource_bytes) + _field(2, scope_spans))
