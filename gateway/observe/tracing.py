"""The gateway's span of a request (tracing on, ``runtime.tracing``): a child of the HTTP
request's ``traceparent`` when it sent a valid one, else the root of a new trace; its own
context is what the request's ``Generate`` carries on to the other roles."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from pdserve.gateway.jobs import Job
from pdserve.runtime.tracing import (
    Attributes,
    SpanKind,
    TraceContext,
    Tracer,
    new_span_id,
    new_trace,
    parse_traceparent,
)


@dataclass
class RequestTrace:
    """One request's span: ``context`` its own (trace id, span id), ``parent`` the client's
    span id ("" for a trace started here), from ``arrived`` (``time.monotonic()``)."""

    tracer: Tracer
    context: TraceContext
    parent: str
    arrived: float
    name: str
    ended: bool = False

    def header(self) -> str:
        return self.context.header()

    def end(self, now: float, attributes: Attributes) -> None:
        if self.ended or not self.context.sampled:
            return
        self.ended = True
        ctx = self.context
        self.tracer.record(
            ctx.trace_id,
            ctx.span_id,
            self.parent,
            self.name,
            self.arrived,
            now,
            attributes,
            SpanKind.SERVER,
        )


def start_trace(
    tracer: Tracer, traceparent: str | None, arrived: float | None, name: str
) -> RequestTrace | None:
    """The request's span, begun at ``arrived`` (``time.monotonic()``; None: now); None with
    tracing off (nothing is parsed)."""
    if not tracer.enabled:
        return None
    arrived = time.monotonic() if arrived is None else arrived
    given = parse_traceparent(traceparent)
    if given is None:
        return RequestTrace(tracer, new_trace(), "", arrived, name)
    return RequestTrace(tracer, given.with_span(new_span_id()), given.span_id, arrived, name)


def with_trace(job: Job, trace: RequestTrace | None) -> Job:
    """``job`` with each of its requests carrying the context of ``trace`` (if any)."""
    if trace is None:
        return job
    header = trace.header()
    requests = [dataclasses.replace(r, trace=header) for r in job.requests]
    return dataclasses.replace(job, requests=requests)
