"""Tool calls as the response carries them: deltas of a stream, and the message's list.

A call opens with a delta that has its id and name (``arguments`` may already hold text), and
goes on with argument fragments; the message's call is their concatenation:

    {"index": 0, "id": "chatcmpl-tool-9f..", "type": "function",
     "function": {"name": "get_weather", "arguments": ""}}
    {"index": 0, "function": {"arguments": "{\\"city\\": "}}
    {"index": 0, "function": {"arguments": "\\"Paris\\"}"}}

Ids are ``chatcmpl-tool-<32 hex>``, as vLLM writes them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    index: int  # the call's place in the message
    arguments: str = ""
    id: str | None = None  # with the name, on the call's first delta only
    name: str | None = None


def call_from_json(value: Any) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a parsed ``{"name": ..., "arguments" | "parameters":
    {...}}``, or None when it is not such an object. Arguments are re-serialized as vLLM does
    (``json.dumps``, non-ASCII kept); a JSON string holding an object is taken too."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def delta_json(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """``delta.tool_calls`` of one chunk: one entry a call, its deltas merged."""
    merged: dict[int, dict[str, Any]] = {}
    for d in deltas:
        entry = merged.get(d.index)
        if entry is None:
            entry = merged[d.index] = {"index": d.index}
            if d.id is not None:
                entry.update(id=d.id, type="function")
            entry["function"] = {"name": d.name} if d.name is not None else {}
            entry["function"]["arguments"] = d.arguments
        else:
            entry["function"]["arguments"] += d.arguments
    return list(merged.values())


def accumulate(calls: list[dict[str, Any]], deltas: list[ToolCallDelta]) -> None:
    """Fold ``deltas`` into a message's ``tool_calls``, in place."""
    for d in deltas:
        if d.index == len(calls):
            function = {"name": d.name or "", "arguments": ""}
            calls.append({"id": d.id, "type": "function", "function": function})
        calls[d.index]["function"]["arguments"] += d.arguments
