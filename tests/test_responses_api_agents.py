"""The OpenAI Agents SDK (``openai-agents``) against ``/v1/responses`` on the real model
(SmolLM2-135M-Instruct, ``pdserve serve`` disaggregated): ``bench/experiments/agents_sdk.py``'s
one-tool agent runs to completion, turn 1 forced to call ``get_weather`` (``tool_choice``
required: constrained), turn 2 answering in text after the tool's result. Greedy: streamed
and non-streamed runs make the same turns."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench.experiments.agents_sdk import main, run_agent
from tests.e2e_util import ServedCluster


@pytest.fixture(scope="module")
def cluster(real_tools_dir: Path) -> Iterator[ServedCluster]:
    c = ServedCluster(real_tools_dir, "--mode=disagg", ready_timeout=180)
    yield c
    c.stop()


def test_the_agent_calls_its_tool_then_answers(cluster: ServedCluster) -> None:
    run = asyncio.run(run_agent(cluster.url, cluster.model_name, max_tokens=48))
    assert run.model_turns == 2
    assert [kind for kind, _ in run.turns] == ["function_call", "tool", "message"]
    [call] = run.calls
    city = call["city"]
    assert isinstance(city, str) and city.strip()
    assert run.turns[0][1] == f"get_weather {json.dumps(call)}"
    assert run.turns[1][1] == f"{city}: 18 C and sunny"
    assert run.final_output.strip() and run.final_output == run.turns[2][1]
    streamed = asyncio.run(run_agent(cluster.url, cluster.model_name, max_tokens=48, stream=True))
    assert (streamed.turns, streamed.model_turns) == (run.turns, 2)


def test_the_script_prints_the_turns(cluster: ServedCluster, capsys: pytest.CaptureFixture) -> None:
    main(["--url", cluster.url, "--model", cluster.model_name, "--max-tokens", "48"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines[:3]] == [
        "function_call",
        "tool",
        "message",
    ]
    assert lines[0].strip().startswith('function_call: get_weather {"city": ')
    assert lines[3].startswith("model turns: 2; final output: ")
