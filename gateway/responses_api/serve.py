"""A started ``JobRun`` as a Responses answer: the ``response`` body (``collect``) or its
server-sent events (``events``), as OpenAI sends them::

    event: response.created       data: {"type": "response.created", "sequence_number": 0,
                                         "response": {... "status": "in_progress"}}
    event: response.in_progress   ...
    event: response.output_item.added ... (the items' events: ``output``)
    event: response.completed     data: {..., "response": {the collected body}}
          (response.incomplete when max_output_tokens cut it, response.failed if aborted)

A failure after the first byte cannot change the status any more: it becomes an ``error``
event (the OpenAI error's message, code, param) and ``response.failed``. No ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pdserve.gateway.errors import OpenAIError, error_body
from pdserve.gateway.responses_api.output import (
    Event,
    NewId,
    OutputItems,
    final_status,
    new_id,
    response_json,
)
from pdserve.gateway.run import JobRun
from pdserve.gateway.sse import sse
from pdserve.gateway.tools.output import ToolOutput

log = logging.getLogger(__name__)

_ABORTED = {"code": "server_error", "message": "the generation was aborted in the cluster"}
_TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


@dataclass(frozen=True)
class ResponsesOutput:
    """How ``Gateway.serve`` answers a Responses job; ``fields``: ``output.echo(request)``."""

    fields: Mapping[str, Any]
    make_id: NewId = new_id
    clock: Callable[[], float] = field(default=time.time)

    async def collect(self, run: JobRun) -> dict[str, Any]:
        items = OutputItems(self.make_id)
        tools = self._tools(run)
        async with aclosing(run.updates()) as updates:
            async for update in updates:
                items.feed(update if tools is None else tools.apply(update))
        items.finish()
        return self._final(run, items)

    async def events(self, run: JobRun) -> AsyncIterator[str]:
        """The SSE body of a started run (module docstring)."""
        job = run.job
        sequence = 0

        def event(body: Event) -> str:
            nonlocal sequence
            body = {"type": body["type"], "sequence_number": sequence, **body}
            sequence += 1
            return f"event: {body['type']}\n{sse(body)}"

        items = OutputItems(self.make_id)
        tools = self._tools(run)
        start = response_json(job, self.fields, "in_progress", [])
        yield event({"type": "response.created", "response": start})
        yield event({"type": "response.in_progress", "response": start})
        try:
            async with aclosing(run.updates()) as updates:
                async for update in updates:
                    for body in items.feed(update if tools is None else tools.apply(update)):
                        yield event(body)
            for body in items.finish():
                yield event(body)
            final = self._final(run, items)
            yield event({"type": _TERMINAL[final["status"]], "response": final})
        except Exception as e:
            error = error_body(e)
            log.warning("request %s: %d %s", job.response_id, error.status, error.message)
            yield event(
                {
                    "type": "error",
                    "code": error.code,
                    "message": error.message,
                    "param": error.param,
                }
            )
            failed = response_json(
                job, self.fields, "failed", items.json(), run.usage, error=failure(error)
            )
            yield event({"type": "response.failed", "response": failed})

    def _tools(self, run: JobRun) -> ToolOutput | None:
        plan = run.job.tools
        return None if plan is None else ToolOutput(plan, 1, lambda: self.make_id("call"))

    def _final(self, run: JobRun, items: OutputItems) -> dict[str, Any]:
        status, incomplete = final_status(items.finish_reason)
        return response_json(
            run.job,
            self.fields,
            status,
            items.json(),
            run.usage,
            incomplete=incomplete,
            error=_ABORTED if status == "failed" else None,
            completed_at=int(self.clock()),
        )


def failure(error: OpenAIError) -> dict[str, Any]:
    """A ``response.error``: OpenAI's codes there are few (rate_limit_exceeded, server_error,
    ...); the error event before it carries the gateway's own."""
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {"code": code, "message": error.message}
