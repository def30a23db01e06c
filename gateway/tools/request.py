"""A chat request's tool fields: checked (a 400 with the reason), turned into what the chat
template takes, and into the plan for the output (``ToolPlan``).

``tool_choice``, with vLLM's semantics:

    absent      "auto" when tools are given, else "none"
    "none"      the tools are still rendered into the prompt (vLLM's default); the output is
                plain content, never parsed
    "auto"      the output is parsed by the template family's parser (``--tool-call-parser``)
    "required"  constrained: a JSON array of ``{"name", "parameters"}`` objects, at least one
                (exactly one with ``parallel_tool_calls: false``)
    named       constrained: the output is that function's arguments object

Refused with a 400: ``tool_choice`` (other than "none") or ``parallel_tool_calls`` without
tools; a named function that is not among the tools; two tools of one name; a parameters
schema over ``MAX_SCHEMA_CHARS``; tools, or assistant ``tool_calls``, for a model whose chat
template does not render them; "auto" where no parser is known for the template; ``arguments``
that are not a JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pdserve.engine.jinja_templates import template_variables
from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import OpenAIError, invalid_request
from pdserve.gateway.tools.models import (
    MAX_SCHEMA_CHARS,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
)

PARSERS = ("hermes", "llama3_json")
TOOL_CALL_TAG = "<tool_call>"
PARSER_CHOICES = ("auto", *PARSERS)


def add_tool_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSER_CHOICES,
        default="auto",
        help='how tool_choice "auto" output becomes tool_calls (auto: from the chat template)',
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='accepted as vLLM takes it: tool_choice "auto" is always on here',
    )


class ToolRequest(Protocol):
    tools: list[Tool] | None
    tool_choice: ToolChoice | None
    parallel_tool_calls: bool | None


@dataclass(frozen=True)
class ToolPlan:
    """How a choice's output becomes tool calls (``gateway.tools.stages``)."""

    mode: Literal["auto", "required", "named"]
    parser: str | None = None  # auto: one of PARSERS
    name: str | None = None  # named: the function
    parallel: bool = True  # more than one call a message


@dataclass(frozen=True)
class TemplateFeatures:
    renders_tools: bool  # the template reads the ``tools`` variable
    renders_tool_calls: bool  # ... and assistant messages' ``tool_calls``
    parser: str | None  # the parser its tool-call format needs, when it is a known one


def effective_choice(req: ToolRequest) -> str | NamedToolChoice:
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def check_tools(req: ToolRequest) -> None:
    """Raise a 400 ``OpenAIError`` for tool fields that cannot be honoured as given."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise invalid_request("tool_choice requires tools", "tool_choice")
        if req.parallel_tool_calls is not None:
            message = "parallel_tool_calls is only allowed when tools are given"
            raise invalid_request(message, "parallel_tool_calls")
        return
    seen: set[str] = set()
    for i, tool in enumerate(req.tools):
        name = tool.function.name
        if name in seen:
            raise invalid_request(f"two tools are named `{name}`", f"tools[{i}].function.name")
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is not None and len(json.dumps(parameters)) > MAX_SCHEMA_CHARS:
            message = f"the parameters schema of `{name}` is over {MAX_SCHEMA_CHARS} characters"
            raise invalid_request(message, f"tools[{i}].function.parameters")
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
        raise unknown_function(choice.function.name)


def unknown_function(name: str) -> OpenAIError:
    return invalid_request(f"tool_choice names the function `{name}`, not in tools", "tool_choice")


def template_tools(req: ToolRequest) -> list[dict[str, Any]] | None:
    """The ``tools`` the chat template renders (with tool_choice "none" too, as vLLM)."""
    if not req.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in req.tools]


def template_tool_calls(calls: list[ToolCall], param: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as templates expect them (Hugging Face's
    convention): ``function.arguments`` a dict, parsed from OpenAI's JSON string as vLLM does
    (empty or absent: ``{}``)."""
    out = []
    for j, call in enumerate(calls):
        arguments = call.function.arguments
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                where = f"{param}[{j}].function.arguments"
                raise invalid_request(f"{where} is not valid JSON: {e}", where) from e
            if not isinstance(arguments, dict):
                where = f"{param}[{j}].function.arguments"
                raise invalid_request(f"{where} must be a JSON object", where)
        elif not isinstance(arguments, dict):
            arguments = {}
        entry: dict[str, Any] = {"type": "function"}
        if call.id is not None:
            entry["id"] = call.id
        entry["function"] = {"name": call.function.name, "arguments": arguments}
        out.append(entry)
    return out


@functools.lru_cache(maxsize=32)
def template_features(template: str) -> TemplateFeatures:
    """What a chat template does with tools: found in its Jinja, not by rendering it."""
    try:
        variables = template_variables(template)
    except ValueError:
        variables = frozenset()  # rendering it will say what is wrong
    if TOOL_CALL_TAG in template:
        parser: str | None = "hermes"
    elif '"parameters"' in template or "ipython" in template:
        parser = "llama3_json"  # Llama 3.1/3.2: bare JSON calls, results in an ipython turn
    else:
        parser = None
    return TemplateFeatures("tools" in variables, "tool_calls" in template, parser)


def check_messages(messages: list[dict[str, Any]], template: str) -> None:
    """400 when a message carries ``tool_calls`` that ``template`` would drop without a word."""
    if template_features(template).renders_tool_calls:
        return
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            raise invalid_request(
                "this model's chat template does not render tool_calls; serve it with a "
                "--chat-template that does",
                f"messages[{i}].tool_calls",
            )


def tool_plan(req: ToolRequest, template: str, parser: str = "auto") -> ToolPlan | None:
    """The output plan for ``req`` under ``template`` (the one its prompt is rendered with);
    None when the output is plain content. ``parser``: ``--tool-call-parser``."""
    choice = effective_choice(req)
    if choice == "none" or not req.tools:
        return None
    features = template_features(template)
    if not features.renders_tools:
        raise invalid_request(
            "this model's chat template does not render tools; serve it with a --chat-template "
            'that does, or send tool_choice "none"',
            "tools",
        )
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", name=choice.function.name, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", parallel=parallel)
    name = features.parser if parser == "auto" else parser
    if name is None:
        raise OpenAIError(
            400,
            '"auto" tool choice needs a tool-call parser, and this model\'s chat template has no '
            "tool-call format pdserve knows; start the gateway with --tool-call-parser "
            + " or ".join(PARSERS),
            param="tool_choice",
        )
    return ToolPlan("auto", parser=name, parallel=parallel)


def uses_special_tool_tokens(plan: ToolPlan, tokenizer: Tokenizer) -> bool:
    """Whether the parser reads a tag the tokenizer holds as a special token (which
    ``skip_special_tokens`` would hide from it)."""
    if plan.mode != "auto" or plan.parser != "hermes":
        return False
    token = tokenizer.token_to_id(TOOL_CALL_TAG)
    return token is not None and token in tokenizer.all_special_ids
