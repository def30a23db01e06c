"""One choice's text in, its content and tool-call deltas out: a stage per output plan.

    hermes       Sure.<tool_call>{"name": "f", "arguments": {..}}</tool_call><tool_call>..
    llama3_json  {"name": "f", "parameters": {..}}; {"name": "g", ..}    (the whole output)
    required     [{"name": "f", "parameters": {..}}, ...]                 (constrained)
    named        {..the arguments..}                                      (constrained)

A streamed response and a non-streamed one run the same stage over the same text, so the
deltas of a stream always add up to the non-streamed message. A parsed call (auto, required)
is emitted once its JSON is complete and valid, its arguments in one fragment: JSON that turns
out malformed falls back to content, with nothing already sent to take back. A named call's
output is its arguments, streamed as they come.

Content: whitespace around tool calls is dropped (held until text follows it); the text of a
choice that makes no call comes out unchanged. With ``parallel_tool_calls: false`` the calls
after the first are dropped, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Protocol

from pdserve.gateway.tools.calls import ToolCallDelta, call_from_json, new_call_id
from pdserve.gateway.tools.request import TOOL_CALL_TAG, ToolPlan

Output = tuple[str, list[ToolCallDelta]]  # (content, tool-call deltas)
TOOL_CALL, END_TOOL_CALL = TOOL_CALL_TAG, "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's tool-call token (gone when special tokens are skipped)


class Stage(Protocol):
    @property
    def calls(self) -> int: ...  # tool calls emitted so far

    def feed(self, text: str) -> Output: ...

    def finish(self) -> Output: ...


def make_stage(plan: ToolPlan, new_id: Callable[[], str] = new_call_id) -> Stage:
    calls = _Calls(plan.parallel, new_id)
    if plan.mode == "named":
        return NamedStage(plan.name or "", calls)
    if plan.mode == "required":
        return JsonCallsStage(calls, array=True)
    if plan.parser == "hermes":
        return HermesStage(calls)
    if plan.parser == "llama3_json":
        return JsonCallsStage(calls, array=False)
    raise ValueError(f"unknown tool-call parser {plan.parser!r}")


class _Calls:
    """Numbers and names the calls of one choice."""

    def __init__(self, parallel: bool, new_id: Callable[[], str]) -> None:
        self.parallel = parallel
        self.new_id = new_id
        self.count = 0

    def emit(self, name: str, arguments: str) -> list[ToolCallDelta]:
        if self.count and not self.parallel:
            return []
        self.count += 1
        return [ToolCallDelta(self.count - 1, arguments, self.new_id(), name)]


class _Content:
    """Content text with its trailing whitespace held back: dropped at a tool call, and at the
    end when a call was made; the whitespace that follows a call is dropped too."""

    def __init__(self) -> None:
        self._held = ""
        self._after_call = False

    def add(self, text: str) -> str:
        text = self._held + text
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        head = text.rstrip()
        self._held = text[len(head) :]
        return head

    def call(self) -> None:
        self._held, self._after_call = "", True

    def flush(self, called: bool) -> str:
        held, self._held = self._held, ""
        return "" if called else held


class NamedStage:
    def __init__(self, name: str, calls: _Calls) -> None:
        self._name = name
        self._calls = calls

    @property
    def calls(self) -> int:
        return self._calls.count

    def feed(self, text: str) -> Output:
        if not text:
            return "", []
        if not self._calls.count:
            return "", self._calls.emit(self._name, text)
        return "", [ToolCallDelta(0, text)]

    def finish(self) -> Output:
        return "", [] if self._calls.count else self._calls.emit(self._name, "")


class HermesStage:
    """``<tool_call>`` blocks anywhere in the text (Qwen 2.5, Hermes, the ChatML templates
    pdserve ships), each holding a call or a list of calls; a block left open at the end is
    parsed as if closed, as vLLM does."""

    def __init__(self, calls: _Calls) -> None:
        self._calls = calls
        self._content = _Content()
        self._buf = ""  # text not decided yet
        self._inside = False  # the buffer is a block's body
        self._searched = 0  # how much of the buffer holds no end tag

    @property
    def calls(self) -> int:
        return self._calls.count

    def feed(self, text: str) -> Output:
        self._buf += text
        content = ""
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._inside:
                i = self._buf.find(TOOL_CALL)
                if i < 0:
                    cut = len(self._buf) - _partial_tag(self._buf, TOOL_CALL)
                    content += self._content.add(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return content, deltas
                content += self._content.add(self._buf[:i])
                self._buf, self._inside, self._searched = self._buf[i + len(TOOL_CALL) :], True, 0
            else:
                j = self._buf.find(END_TOOL_CALL, max(0, self._searched - len(END_TOOL_CALL)))
                if j < 0:
                    self._searched = len(self._buf)
                    return content, deltas
                body, self._buf = self._buf[:j], self._buf[j + len(END_TOOL_CALL) :]
                self._inside = False
                more, new = self._block(body, END_TOOL_CALL)
                content, deltas = content + more, deltas + new

    def finish(self) -> Output:
        if self._inside:
            content, deltas = self._block(self._buf, "")
        else:
            content, deltas = self._content.add(self._buf), []
        self._buf = ""
        return content + self._content.flush(self._calls.count > 0), deltas

    def _block(self, body: str, end: str) -> Output:
        """One block: a call, or a list of calls (SmolLM's way); else it is content."""
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        calls = [call_from_json(v) for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            return self._content.add(TOOL_CALL + body + end), []
        self._content.call()
        return "", [d for call in calls if call is not None for d in self._calls.emit(*call)]


class JsonCallsStage:
    """JSON call objects: the whole output as ``{..}; {..}`` (llama3_json: the output is tool
    calls only when it opens with ``{`` or the python tag, as in vLLM; else it is content) or
    as an array ``[{..}, {..}]`` (required). Text that breaks the pattern, and everything
    after it, is content; all of the output when no call was made before it."""

    def __init__(self, calls: _Calls, array: bool) -> None:
        self._calls = calls
        self._array = array
        self._separators = " \t\r\n," if array else " \t\r\n;"
        self._state = "start"  # start -> calls -> content | done (array closed)
        self._raw = ""  # the output since the last call (all of it before the first)
        self._pos = 0  # scanned up to here
        self._start = 0  # where the object being read began
        self._depth = 0
        self._in_string = self._escaped = False

    @property
    def calls(self) -> int:
        return self._calls.count

    def feed(self, text: str) -> Output:
        if self._state == "content":
            return text, []
        self._raw += text
        if self._state == "start" and not self._open():
            return self._fallback(self._raw, 0) if self._state == "content" else ("", [])
        return self._scan()

    def finish(self) -> Output:
        if self._state != "content" and (self._depth or not self._calls.count):
            return self._fallback(self._raw, self._start if self._depth else self._pos)
        return "", []

    def _open(self) -> bool:
        """Past the opening (``[``, or llama3's optional python tag)? Else still unsure, or the
        state is now content."""
        body = self._raw.lstrip()
        skipped = len(self._raw) - len(body)
        opener = "[" if self._array else PYTHON_TAG
        if body.startswith(opener):
            self._pos = skipped + len(opener)
        elif not body or (opener.startswith(body) and not self._array):
            return False
        elif body[0] == "{" and not self._array:
            self._pos = skipped
        else:
            self._state = "content"
            return False
        self._state = "calls"
        return True

    def _scan(self) -> Output:
        raw = self._raw
        deltas: list[ToolCallDelta] = []
        i = self._pos
        while i < len(raw):
            c = raw[i]
            i += 1
            if self._state == "done":
                if not c.isspace():
                    return self._fallback(raw, i - 1, deltas)
            elif self._depth == 0:
                if c == "{":
                    self._start, self._depth = i - 1, 1
                elif c == "]" and self._array:
                    self._state = "done"
                elif c not in self._separators:
                    return self._fallback(raw, i - 1, deltas)
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    call = _parse_call(raw[self._start : i])
                    if call is None:
                        return self._fallback(raw, self._start, deltas)
                    deltas += self._calls.emit(*call)
                    raw, i = raw[i:], 0
        self._raw, self._pos = raw, i
        return "", deltas

    def _fallback(self, raw: str, at: int, deltas: list[ToolCallDelta] | None = None) -> Output:
        """The rest is content: ``raw`` (the text since the last call) from ``at`` on, or all
        of it when no call was made."""
        content = raw[at:].lstrip(self._separators) if self._calls.count else raw
        self._state, self._raw, self._depth = "content", "", 0
        return content, deltas or []


def _parse_call(text: str) -> tuple[str, str] | None:
    try:
        return call_from_json(json.loads(text))
    except ValueError:
        return None


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (and might complete it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
