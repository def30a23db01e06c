"""A Responses request as the chat request it stands for, and the ``Job`` that serves it.

``input`` items map onto chat messages as vLLM maps them::

    instructions                          {"role": "system", "content": instructions} first
    "text" (a string input)               {"role": "user", "content": "text"}
    {"role": r, "content": parts}         {"role": r, "content": the parts' text joined}
    {"type": "function_call", call_id,    an assistant message's tool_calls entry (appended to
     name, arguments}                     the assistant message just before it, if any)
    {"type": "function_call_output",      {"role": "tool", "tool_call_id": call_id,
     call_id, output}                      "content": output}

``tools`` (flat) become chat's ``{"type": "function", "function": {...}}``, a named
``tool_choice`` ``{"type": "function", "function": {"name"}}``, ``text.format`` chat's
``response_format``, ``max_output_tokens`` ``max_completion_tokens``. Without tools,
``tool_choice`` "auto"/"none" and ``parallel_tool_calls`` are dropped (OpenAI takes them).
A 400 raised on the chat request names the Responses field (``responses_param``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import OpenAIError, from_validation, invalid_request
from pdserve.gateway.jobs import Job, prepare_chat
from pdserve.gateway.openai_models import ChatCompletionRequest
from pdserve.gateway.responses_api.models import ContentPart, InputItem, ResponsesRequest
from pdserve.gateway.tenancy.tenants import Tenant
from pdserve.protocol import messages as m

TEXT_PARTS = ("input_text", "output_text", "refusal")
ITEM_TYPES = ("message", "function_call", "function_call_output")
_STORE = "this server keeps no responses (send the whole conversation in input)"


def check_supported(req: ResponsesRequest) -> None:
    """Refuse (400, naming the field) what parses but this server cannot honour."""
    if req.store:
        raise invalid_request(f"store: true is not supported: {_STORE}", "store")
    if req.previous_response_id is not None:
        raise invalid_request(
            f"previous_response_id is not supported: {_STORE}", "previous_response_id"
        )
    if req.conversation is not None:
        raise invalid_request(f"conversation is not supported: {_STORE}", "conversation")
    if req.background:
        raise invalid_request(
            "background: true is not supported: responses are served while the request waits",
            "background",
        )
    if req.prompt is not None:
        raise invalid_request("prompt templates are not supported", "prompt")
    if req.reasoning is not None and (req.reasoning.effort or req.reasoning.summary):
        raise invalid_request("reasoning is not supported: the output is plain text", "reasoning")
    if req.include:
        raise invalid_request(
            f"include `{req.include[0]}` is not supported: no such output is produced", "include"
        )
    if req.top_logprobs:
        raise invalid_request("top_logprobs is not supported", "top_logprobs")
    if req.truncation == "auto":
        raise invalid_request(
            'truncation "auto" is not supported: an input beyond the context is refused instead',
            "truncation",
        )
    if req.text is not None and req.text.verbosity is not None:
        raise invalid_request("text.verbosity is not supported", "text.verbosity")
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise invalid_request(
                f"tool type `{tool.type}` is not supported: only function tools are served",
                f"tools[{i}].type",
            )
        if tool.name is None:
            raise invalid_request("a function tool needs a name", f"tools[{i}].name")
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        if choice.type != "function":
            raise invalid_request(
                f'tool_choice type `{choice.type}` is not supported: "none", '
                '"auto", "required" or a function',
                "tool_choice",
            )
        if choice.name is None:
            raise invalid_request("tool_choice needs the function's name", "tool_choice.name")


def chat_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (module docstring)."""
    if not req.input:
        raise invalid_request("input must not be empty", "input")
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    calls: set[str] = set()  # call ids seen so far
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "message":
            role = _required(item.role, f"{where}.role")
            content = _text(_required(item.content, f"{where}.content"), f"{where}.content")
            messages.append({"role": role, "content": content})
        elif item.type == "function_call":
            call = _tool_call(item, where)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            call_id = _required(item.call_id, f"{where}.call_id")
            if call_id not in calls:
                raise invalid_request(
                    f"no function_call before it has call_id `{call_id}`", f"{where}.call_id"
                )
            output = _text(_required(item.output, f"{where}.output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise invalid_request(
                f"input item type `{item.type}` is not supported: one of {', '.join(ITEM_TYPES)}",
                f"{where}.type",
            )
    return messages


def _required(value: Any, param: str) -> Any:
    if value is None:
        raise invalid_request(f"{param} is required", param)
    return value


def _text(parts: list[ContentPart], param: str) -> str:
    """The text of a message's parts, joined as chat joins its text parts."""
    texts = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PARTS:
            raise invalid_request(
                f"content type `{part.type}` is not supported: only text is served",
                f"{param}[{j}].type",
            )
        field = "refusal" if part.type == "refusal" else "text"
        texts.append(_required(getattr(part, field), f"{param}[{j}].{field}"))
    return "\n".join(texts)


def _tool_call(item: InputItem, where: str) -> dict[str, Any]:
    call_id = _required(item.call_id, f"{where}.call_id")
    name = _required(item.name, f"{where}.name")
    arguments = _required(item.arguments, f"{where}.arguments")
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError as e:
        message = f"{where}.arguments is not valid JSON: {e}"
        raise invalid_request(message, f"{where}.arguments") from None
    if not isinstance(parsed, dict):
        raise invalid_request(f"{where}.arguments must be a JSON object", f"{where}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request ``req`` stands for (checked: ``check_supported`` first)."""
    check_supported(req)
    body: dict[str, Any] = {"model": req.model or "", "messages": chat_messages(req)}
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
        if req.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = req.parallel_tool_calls
    choice = req.tool_choice
    if isinstance(choice, str) and (req.tools or choice == "required"):
        body["tool_choice"] = choice
    elif choice is not None and not isinstance(choice, str):
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise invalid_request("text.format json_schema needs a schema", "text.format.schema")
        schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    fields = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "priority")
    body.update({f: getattr(req, f) for f in fields if getattr(req, f) is not None})
    body["max_completion_tokens"] = req.max_output_tokens
    body["stream"] = bool(req.stream)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # checked above: only a bug lands here, said as a 400
        raise from_validation(RequestValidationError(e.errors())) from None


_RENAMES = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
}
_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function\.(\w+)")


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat request's ``param`` stands for."""
    if param is None:
        return None
    if param.startswith("messages"):
        return "input"
    if found := _TOOL_FIELD.fullmatch(param):
        return f"tools[{found[1]}].{found[2]}"
    return _RENAMES.get(param, param)


def prepare_response(
    req: ResponsesRequest, tokenizer: Tokenizer, model: m.ServedModel, tool_parser: str = "auto"
) -> Job:
    """The chat ``Job`` of ``req``, its id ``resp_<hex>`` (its backend request's too)."""
    try:
        job = prepare_chat(chat_request(req), tokenizer, model, tool_parser)
    except OpenAIError as e:
        if e.param is not None and e.param.startswith("messages"):
            e.message = e.message.replace("the messages", "the input")
        e.param = responses_param(e.param)
        raise
    response_id = f"resp_{uuid.uuid4().hex}"
    requests = [dataclasses.replace(r, request_id=response_id) for r in job.requests]
    return dataclasses.replace(job, response_id=response_id, requests=requests)


def check_output_tokens(req: ResponsesRequest, tenant: Tenant) -> None:
    """``max_output_tokens`` over the key's per-request cap: a 400 (``tenancy.request``'s
    ``check_max_tokens`` for this body)."""
    cap, asked = tenant.max_tokens, req.max_output_tokens
    if cap is not None and asked is not None and asked > cap:
        message = f"max_output_tokens is {asked}, more than this key's limit of {cap} per request"
        raise OpenAIError(400, message, param="max_output_tokens", code="max_tokens_exceeded")
