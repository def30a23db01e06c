"""A one-tool agent of the OpenAI Agents SDK (``openai-agents``) run to completion against a
served pdserve, through its Responses API (``OpenAIResponsesModel`` -> ``POST /v1/responses``).

    pdserve serve --model ~/.cache/pdserve/models/SmolLM2-135M-Instruct --port 8000 &
    .venv/bin/python bench/experiments/agents_sdk.py --url http://127.0.0.1:8000 \\
        --model SmolLM2-135M-Instruct [--stream]

The agent has one function tool, ``get_weather(city)``. A 135M model seldom calls a tool by
itself, so the run is made deterministic with the SDK's own settings: temperature 0, turn 1
forced to call a tool (``ModelSettings(tool_choice="required")``: constrained decoding on the
server), and the tool enabled only until it has run (``is_enabled``), so that turn 2, given
the tool's result, answers in text (the SDK's ``reset_tool_choice`` then leaves tool_choice
unset, and without tools the output is plain text). The turns, as SmolLM2-135M-Instruct
makes them (2026-11-29, 4-7 s on this 2-core machine)::

    function_call: get_weather {"city": "Paris"}
             tool: Paris: 18 C and sunny
          message: Paris: 18 C and sunny
    model turns: 2; final output: "Paris: 18 C and sunny"
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    RunContextWrapper,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.agent import AgentBase
from agents.items import ItemHelpers, MessageOutputItem, ToolCallItem, ToolCallOutputItem
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI

QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "You are a helpful assistant. Use the get_weather tool to answer."


@dataclass
class AgentRun:
    """What the agent did: ``turns`` as (kind, detail) in order, ``calls`` the tool's
    arguments per call, ``final_output`` the last message's text."""

    turns: list[tuple[str, str]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    final_output: str = ""
    model_turns: int = 0


async def run_agent(
    url: str,
    model: str,
    *,
    question: str = QUESTION,
    max_tokens: int = 64,
    stream: bool = False,
    api_key: str = "none",
) -> AgentRun:
    """Run the agent once against ``url`` (the server root) and serving ``model``."""
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI otherwise
    run = AgentRun()

    def tool_unused(ctx: RunContextWrapper[Any], agent: AgentBase) -> bool:
        return not run.calls

    @function_tool(is_enabled=tool_unused)
    def get_weather(city: str) -> str:
        """The current weather in a city.

        Args:
            city: The city's name.
        """
        run.calls.append({"city": city})
        return f"{city}: 18 C and sunny"

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=300)
    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=OpenAIResponsesModel(model=model, openai_client=client),
        model_settings=ModelSettings(
            temperature=0.0, tool_choice="required", max_tokens=max_tokens
        ),
    )
    if stream:
        streamed = Runner.run_streamed(agent, question, max_turns=4)
        async for _ in streamed.stream_events():
            pass
        items, responses, final = streamed.new_items, streamed.raw_responses, streamed.final_output
    else:
        result = await Runner.run(agent, question, max_turns=4)
        items, responses, final = result.new_items, result.raw_responses, result.final_output
    run.model_turns = len(responses)
    for item in items:
        if isinstance(item, ToolCallItem):
            raw = item.raw_item
            name, arguments = getattr(raw, "name", "?"), getattr(raw, "arguments", "")
            run.turns.append(("function_call", f"{name} {arguments}"))
        elif isinstance(item, ToolCallOutputItem):
            run.turns.append(("tool", str(item.output)))
        elif isinstance(item, MessageOutputItem):
            run.turns.append(("message", ItemHelpers.text_message_output(item)))
    run.final_output = str(final)
    await client.close()
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's root URL")
    parser.add_argument("--model", required=True, help="the served model's name")
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--max-tokens", type=int, default=64, help="max_output_tokens a turn")
    parser.add_argument("--stream", action="store_true", help="stream each turn (SSE)")
    parser.add_argument("--api-key", default="none")
    args = parser.parse_args(argv)
    run = asyncio.run(
        run_agent(
            args.url,
            args.model,
            question=args.question,
            max_tokens=args.max_tokens,
            stream=args.stream,
            api_key=args.api_key,
        )
    )
    for kind, detail in run.turns:
        print(f"{kind:>13}: {detail}")
    print(f"model turns: {run.model_turns}; final output: {json.dumps(run.final_output)}")


if __name__ == "__main__":
    main()
