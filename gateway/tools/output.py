"""A generation's text through its tool-call stage, choice by choice (``ToolOutput``): what the
chat and the Responses API bodies are built from when a request has tools."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pdserve.gateway.choices import ChoiceUpdate
from pdserve.gateway.tools.calls import new_call_id
from pdserve.gateway.tools.request import ToolPlan
from pdserve.gateway.tools.stages import make_stage


class ToolOutput:
    """The hook between a generation's updates and the response: each choice's text goes
    through its tool-call stage (``gateway.tools.stages``), streamed and non-streamed alike;
    owns one stage a choice::

        ChoiceUpdate(text) --stage--> ChoiceUpdate(text=content, tool_calls=deltas)

    ``finish_reason`` "stop" becomes "tool_calls" when the choice made a call ("length" stays:
    the last call's arguments may be cut short)."""

    def __init__(
        self, plan: ToolPlan, num_choices: int, new_id: Callable[[], str] = new_call_id
    ) -> None:
        self._stages = [make_stage(plan, new_id) for _ in range(num_choices)]

    @classmethod
    def of(cls, plan: ToolPlan | None, num_choices: int) -> ToolOutput | None:
        return None if plan is None else cls(plan, num_choices)

    def apply(self, update: ChoiceUpdate) -> ChoiceUpdate:
        stage = self._stages[update.index]
        content, deltas = stage.feed(update.text)
        finish = update.finish_reason
        if finish is not None:
            more, last = stage.finish()
            content, deltas = content + more, deltas + last
            if finish == "stop" and stage.calls:
                finish = "tool_calls"
        return dataclasses.replace(update, text=content, tool_calls=deltas, finish_reason=finish)
