"""The Responses API's output: one choice's updates (after the tool-call stage) become output
items and the events that build them; the ``response`` object around them.

Items come in the order the text makes them; a change of kind closes the item before::

    content text      -> message        {"id": "msg_..", "content": [{"type": "output_text"..}]}
    a tool call       -> function_call  {"id": "fc_..", "call_id": "call_..", "name", "arguments"}
    nothing at all    -> one empty message (the response always says something)

Events of each item (``serve`` numbers them)::

    message        output_item.added  content_part.added  output_text.delta...
                   output_text.done  content_part.done  output_item.done
    function_call  output_item.added  function_call_arguments.delta...
                   function_call_arguments.done  output_item.done

A collected response and a streamed one run the same ``OutputItems`` over the same updates,
so the stream's last ``response`` is the collected body.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.gateway.choices import ChoiceUpdate
from pdserve.gateway.jobs import Job
from pdserve.gateway.responses_api.models import ResponsesRequest
from pdserve.gateway.run import Usage
from pdserve.gateway.tools.calls import ToolCallDelta

Event = dict[str, Any]  # one stream event, without its sequence number
Status = Literal["in_progress", "completed", "incomplete", "failed"]
NewId = Callable[[str], str]  # prefix -> a fresh id


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """One output item being written: a message (``text``) or a function call."""

    id: str
    index: int  # its place in the output
    kind: Literal["message", "function_call"]
    text: str = ""  # the message's text, or the call's arguments
    call_id: str = ""
    name: str = ""
    status: Status = "in_progress"

    def json(self) -> dict[str, Any]:
        if self.kind == "function_call":
            return {
                "id": self.id,
                "type": "function_call",
                "status": self.status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text,
            }
        content = [output_text(self.text)] if self.status != "in_progress" else []
        return {
            "id": self.id,
            "type": "message",
            "status": self.status,
            "role": "assistant",
            "content": content,
        }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputItems:
    """One choice's output items (``items``, in order) and their events, fed its updates."""

    def __init__(self, make_id: NewId = new_id) -> None:
        self._new_id = make_id
        self.items: list[_Item] = []
        self._open: _Item | None = None
        self.finish_reason: str | None = None

    def json(self) -> list[dict[str, Any]]:
        return [item.json() for item in self.items]

    def feed(self, update: ChoiceUpdate) -> list[Event]:
        events = self._text(update.text) if update.text else []
        for delta in update.tool_calls:
            events += self._call(delta)
        self.finish_reason = update.finish_reason or self.finish_reason
        return events

    def finish(self) -> list[Event]:
        """Close the open item (incomplete when the output was cut short); an output with no
        item gets an empty message."""
        events = [] if self.items else self._open_message()
        status: Status = (
            "completed" if self.finish_reason in ("stop", "tool_calls") else "incomplete"
        )
        return events + self._close(status)

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if item is None or item.kind != "message":
            events = self._close("completed") + self._open_message()
            item = self.items[-1]
        item.text += text
        events.append(
            self._at(item, "response.output_text.delta", content_index=0, delta=text, logprobs=[])
        )
        return events

    def _call(self, delta: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if delta.id is not None or item is None or item.kind != "function_call":
            events = self._close("completed")
            item = self._add("fc", "function_call", call_id=delta.id or "", name=delta.name or "")
            events.append(self._added(item))
        if delta.arguments:
            item.text += delta.arguments
            events.append(
                self._at(item, "response.function_call_arguments.delta", delta=delta.arguments)
            )
        return events

    def _open_message(self) -> list[Event]:
        item = self._add("msg", "message")
        part = self._at(item, "response.content_part.added", content_index=0, part=output_text(""))
        return [self._added(item), part]

    def _add(
        self,
        prefix: str,
        kind: Literal["message", "function_call"],
        call_id: str = "",
        name: str = "",
    ) -> _Item:
        item = _Item(self._new_id(prefix), len(self.items), kind, call_id=call_id, name=name)
        self.items.append(item)
        self._open = item
        return item

    def _added(self, item: _Item) -> Event:
        return {
            "type": "response.output_item.added",
            "output_index": item.index,
            "item": item.json(),
        }

    def _close(self, status: Status) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        events: list[Event] = []
        if item.kind == "message":
            events.append(
                self._at(
                    item, "response.output_text.done", content_index=0, text=item.text, logprobs=[]
                )
            )
            events.append(
                self._at(
                    item, "response.content_part.done", content_index=0, part=output_text(item.text)
                )
            )
        else:
            events.append(
                self._at(item, "response.function_call_arguments.done", arguments=item.text)
            )
        events.append(
            {"type": "response.output_item.done", "output_index": item.index, "item": item.json()}
        )
        return events

    def _at(self, item: _Item, kind: str, **fields: Any) -> Event:
        return {"type": kind, "item_id": item.id, "output_index": item.index, **fields}


def echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request fields a ``response`` repeats, defaults filled in as OpenAI fills them."""
    choice = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": dict(req.metadata or {}),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)}
        if fmt is not None
        else {"format": {"type": "text"}},
        "tool_choice": choice.model_dump(exclude_none=True)
        if choice is not None and not isinstance(choice, str)
        else choice or "auto",
        "tools": [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": t.strict,
            }
            for t in req.tools or []
        ],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "user": req.user,
    }


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        # cache_write_tokens: the SDK's type requires it; no prompt is billed for writing here
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def final_status(finish_reason: str | None) -> tuple[Status, dict[str, Any] | None]:
    """The response's status and ``incomplete_details`` for how its choice finished."""
    if finish_reason in ("stop", "tool_calls"):
        return "completed", None
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "failed", None  # aborted in the cluster


def response_json(
    job: Job,
    fields: Mapping[str, Any],
    status: Status,
    output: list[dict[str, Any]],
    usage: Usage | None = None,
    *,
    incomplete: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """The ``response`` object; ``fields``: ``echo(request)``; ``completed_at`` only when the
    status is completed."""
    return {
        "id": job.response_id,
        "object": "response",
        "created_at": job.created,
        "status": status,
        "completed_at": completed_at if status == "completed" else None,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": fields["instructions"],
        "max_output_tokens": fields["max_output_tokens"],
        "max_tool_calls": None,
        "model": job.model,
        "output": output,
        "parallel_tool_calls": fields["parallel_tool_calls"],
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": fields["temperature"],
        "text": fields["text"],
        "tool_choice": fields["tool_choice"],
        "tools": fields["tools"],
        "top_logprobs": 0,
        "top_p": fields["top_p"],
        "truncation": "disabled",
        "usage": None if usage is None else usage_json(usage),
        "user": fields["user"],
        "metadata": fields["metadata"],
    }
