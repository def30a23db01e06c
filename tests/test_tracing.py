"""Traces and phases of real requests: W3C ``traceparent`` parsing, the OTLP/HTTP exporter
(decoded with ``opentelemetry-proto``, and against a dead collector), and a served cluster
exporting to a test receiver: one span per role under the client's trace, and the request's
phase histograms adding up to the time the client measured."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdserve.runtime.otlp import OtlpTracer
from pdserve.runtime.sockets import free_port
from pdserve.runtime.tracing import (
    SpanKind,
    TraceContext,
    otlp_endpoint,
    parse_traceparent,
    tracer_from_args,
)
from tests.e2e_util import ServedCluster

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
ROLES = ["pdserve-coordinator", "pdserve-decode", "pdserve-gateway", "pdserve-prefill"]
PHASES = [
    "gateway_queue",
    "coordinator_wait",
    "prefill_queue",
    "prefill_compute",
    "kv_transfer",
    "first_decode_step",
]
# What the phases of one request (max_tokens 2: it ends with its first decode step) leave out
# of the client's time: the HTTP client and server before the request reaches the gateway and
# after token 1, and the hops between roles (coordinator → prefill worker, TransferDone via
# the coordinator, token 1 to the gateway): a few ms each on one machine; slack for a busy one.
GAP_S = 0.1
GAP_SHARE = 0.25  # of the client's time


# ---- traceparent -----------------------------------------------------------------------------


def test_a_valid_traceparent_parses() -> None:
    assert parse_traceparent(VALID) == TraceContext(TRACE_ID, CLIENT_SPAN, 1)
    assert parse_traceparent(VALID[:-2] + "00").sampled is False  # type: ignore[union-attr]
    assert TraceContext(TRACE_ID, CLIENT_SPAN, 1).header() == VALID


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        VALID.upper(),  # hex digits are lower-case
        "01" + VALID[2:],  # only version 00 is read
        "ff" + VALID[2:],
        VALID + "-extra",
        VALID[:-1],
        f"00-{'0' * 32}-{CLIENT_SPAN}-01",  # all-zero ids are invalid
        f"00-{TRACE_ID}-{'0' * 16}-01",
        VALID.replace("-", "_"),
        VALID.replace("4bf9", "4bg9"),
        " " + VALID[1:],
    ],
)
def test_anything_else_is_ignored(value: str | None) -> None:
    assert parse_traceparent(value) is None


def test_otlp_endpoint_flag() -> None:
    assert otlp_endpoint("http://c:4318") == "http://c:4318/v1/traces"
    assert otlp_endpoint("http://c:4318/") == "http://c:4318/v1/traces"
    assert otlp_endpoint("https://c/x/v1/traces") == "https://c/x/v1/traces"
    for bad in ("c:4318", "ftp://c/", "http://", "http://c:port/"):
        with pytest.raises(argparse.ArgumentTypeError):
            otlp_endpoint(bad)


def test_off_imports_no_exporter() -> None:
    """Without --otlp-endpoint no role imports the exporter (nor builds a span)."""
    code = (
        "import argparse, sys\n"
        "import pdserve.gateway.main, pdserve.coordinator.main, pdserve.worker.process\n"
        "from pdserve.runtime.tracing import NO_TRACER, tracer_from_args\n"
        "assert tracer_from_args(argparse.Namespace(otlp_endpoint=None), 'x') is NO_TRACER\n"
        "assert 'pdserve.runtime.otlp' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- the exporter ----------------------------------------------------------------------------


class Receiver:
    """A test OTLP/HTTP collector: decodes each POSTed ``ExportTraceServiceRequest``; its spans
    as (service, trace id, span id, parent id, name, kind, start, end, attributes)."""

    def __init__(self) -> None:
        self.spans: list[tuple] = []
        self.requests = 0
        spans, receiver = self.spans, self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/traces"
                assert self.headers["Content-Type"] == "application/x-protobuf"
                export = ExportTraceServiceRequest.FromString(body)
                receiver.requests += 1
                for rs in export.resource_spans:
                    attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            spans.append(
                                (
                                    attrs["service.name"],
                                    s.trace_id.hex(),
                                    s.span_id.hex(),
                                    s.parent_span_id.hex(),
                                    s.name,
                                    s.kind,
                                    s.start_time_unix_nano,
                                    s.end_time_unix_nano,
                                    {a.key: _value(a.value) for a in s.attributes},
                                )
                            )
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of_trace(self, trace_id: str, count: int, timeout: float = 15.0) -> list[tuple]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in list(self.spans) if s[1] == trace_id]
            if len(found) >= count:
                return found
            time.sleep(0.05)
        return [s for s in list(self.spans) if s[1] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: object) -> object:
    return getattr(v, v.WhichOneof("value"))  # type: ignore[attr-defined]


def test_exported_spans_decode_as_otlp() -> None:
    receiver = Receiver()
    tracer = OtlpTracer(f"{receiver.url}/v1/traces", "pdserve-test")
    try:
        now = time.monotonic()
        tracer.span("job", VALID, now - 0.5, now, {"a": "x", "n": 3, "s": 0.25, "b": True})
        tracer.record(TRACE_ID, "1" * 16, "", "root", now - 1, now, {}, SpanKind.SERVER)
        (job, root) = receiver.of_trace(TRACE_ID, 2)
        assert job[0] == "pdserve-test" and job[4] == "job" and job[3] == CLIENT_SPAN
        assert job[8] == {"a": "x", "n": 3, "s": 0.25, "b": True}
        assert 0.49e9 < job[7] - job[6] < 0.51e9  # its length, from the monotonic clock
        assert abs(job[7] / 1e9 - time.time()) < 5  # Unix time
        assert (root[3], root[5]) == ("", SpanKind.SERVER)  # no parent: a trace's root
    finally:
        tracer.close()
        receiver.close()
    assert tracer.sent == 2 and tracer.dropped == 0


def test_a_dead_collector_never_blocks() -> None:
    """Refused connections and a collector that accepts but never answers: recording stays
    a queue put, what cannot be sent is dropped and counted, closing is bounded."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # connections complete in the kernel; nobody ever reads
    endpoints = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{silent.getsockname()[1]}"]
    try:
        for url in endpoints:
            tracer = OtlpTracer(f"{url}/v1/traces", "pdserve-test")
            now = time.monotonic()
            begun = time.perf_counter()
            for i in range(20000):  # more than the queue holds
                tracer.span("s", VALID, now, now, {"i": i})
            assert time.perf_counter() - begun < 2.0  # ~µs each, never a network wait
            begun = time.perf_counter()
            tracer.close()
            assert time.perf_counter() - begun < 5.0
            assert tracer.sent == 0 and tracer.dropped > 0
    finally:
        silent.close()


# ---- a served cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced(tiny_dir):
    receiver = Receiver()
    cluster = ServedCluster(
        tiny_dir,
        "--num-kv-blocks=256",
        "--max-local-prefill-tokens=0",  # every prompt through a prefill worker and a transfer
        f"--otlp-endpoint={receiver.url}",
    )
    yield cluster, receiver
    cluster.stop()
    receiver.close()


def complete(cluster: ServedCluster, headers: dict[str, str] | None = None) -> tuple[dict, float]:
    """A /v1/completions of two tokens (token 0, then one decode step) and its client time."""
    body = {
        "model": cluster.model_name,
        "prompt": "where did the time go " * 8,
        "max_tokens": 2,
        "ignore_eos": True,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{cluster.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    begun = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    return answer, time.perf_counter() - begun


def phase_sums(metrics: str) -> dict[str, tuple[float, float]]:
    """phase -> (sum, count) of ``pdserve_request_phase_seconds``."""
    out: dict[str, list[float]] = {}
    for kind, labels, value in re.findall(
        r"^pdserve_request_phase_seconds_(sum|count)\{([^}]*)\} (\S+)$", metrics, re.M
    ):
        phase = re.search(r'phase="([^"]+)"', labels).group(1)  # type: ignore[union-attr]
        out.setdefault(phase, [0.0, 0.0])[kind == "count"] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_phases_add_up_to_the_clients_time(traced) -> None:
    cluster, _ = traced
    complete(cluster)  # the first: the gateway loads the tokenizer, the engines warm up
    before = phase_sums(cluster.metrics())
    answer, e2e = complete(cluster)
    assert answer["usage"]["completion_tokens"] == 2
    after = phase_sums(cluster.metrics())
    delta = {p: after[p][0] - before.get(p, (0.0, 0.0))[0] for p in after}
    assert {p: after[p][1] - before.get(p, (0.0, 0.0))[1] for p in after} == dict.fromkeys(
        PHASES, 1.0
    )  # each phase once for the request
    total = sum(delta.values())
    figures = ", ".join(f"{p} {delta[p] * 1e3:.2f} ms" for p in PHASES)
    print(f"phases of one request: {figures}; sum {total * 1e3:.2f} ms, client {e2e * 1e3:.2f} ms")
    assert total <= e2e  # durations inside the client's time, never overlapping
    assert e2e - total <= GAP_S + GAP_SHARE * e2e, figures
    labels = f'model="{cluster.model_name}",phase="kv_transfer"'
    assert f"pdserve_request_phase_seconds_count{{{labels}}}" in cluster.metrics()


def test_one_span_per_role_under_the_clients_trace(traced) -> None:
    cluster, receiver = traced
    answer, _ = complete(cluster, {"traceparent": VALID})
    spans = receiver.of_trace(TRACE_ID, 4)
    by_role = {s[0]: s for s in spans}
    assert sorted(s[0] for s in spans) == ROLES  # one each
    gateway = by_role["pdserve-gateway"]
    coordinator = by_role["pdserve-coordinator"]
    assert gateway[3] == CLIENT_SPAN and gateway[5] == SpanKind.SERVER
    assert coordinator[3] == gateway[2]
    for role in ("pdserve-prefill", "pdserve-decode"):
        assert by_role[role][3] == coordinator[2]
    for s in spans:
        assert s[8]["pdserve.request_id"] == answer["id"]
        assert gateway[6] <= s[6] <= s[7] <= gateway[7] + 5e6  # inside the request's span


def test_a_bad_traceparent_starts_a_new_trace(traced) -> None:
    cluster, receiver = traced
    bad = VALID.replace(TRACE_ID, TRACE_ID.upper())
    answer, _ = complete(cluster, {"traceparent": bad})  # never a 4xx
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        mine = [s for s in list(receiver.spans) if s[8].get("pdserve.request_id") == answer["id"]]
        if len(mine) == 4:
            break
        time.sleep(0.05)
    assert len({s[1] for s in mine}) == 1 and mine[0][1] != TRACE_ID.lower()
    assert [s[3] for s in mine if s[0] == "pdserve-gateway"] == [""]  # its root


def test_serving_goes_on_with_the_collector_gone(traced) -> None:
    cluster, receiver = traced
    receiver.close()
    begun = time.perf_counter()
    for _ in range(3):
        answer, _ = complete(cluster, {"traceparent": VALID})
        assert answer["usage"]["completion_tokens"] == 2
    assert time.perf_counter() - begun < 10


def test_tracer_from_args_with_an_endpoint_exports() -> None:
    tracer = tracer_from_args(argparse.Namespace(otlp_endpoint="http://127.0.0.1:9/v1/traces"), "x")
    try:
        assert tracer.enabled and isinstance(tracer, OtlpTracer)
    finally:
        tracer.close()
