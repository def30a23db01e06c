"""Request models, their conversion to SamplingParams, and OpenAI error bodies."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.errors import OpenAIError, error_param, from_validation, model_not_found
from pdserve.gateway.jobs import prepare_chat, prepare_completion, sampling_params
from pdserve.gateway.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
)
from pdserve.protocol.sampling import SamplingParams
from tests.gateway_util import served_model

MODEL = served_model("tiny", max_model_len=64)


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_dir(model_dirs["llama"])


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def validation_error(model: type, body: dict) -> RequestValidationError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()]
    return RequestValidationError(errors)


def test_chat_fields_and_unknown_extras() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ],
        max_tokens=5,
        max_completion_tokens=7,
        logprobs=True,
        top_logprobs=3,
        stop="END",
        user="someone",
        some_future_field={"x": 1},
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    assert req.requested_max_tokens() == 7
    assert req.stop_strings() == ["END"]
    assert sampling_params(req, 7) == SamplingParams(max_tokens=7, logprobs=3)


def test_sampling_params_carry_every_set_field() -> None:
    req = CompletionRequest.model_validate(
        {
            "model": "tiny",
            "prompt": "x",
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "presence_penalty": 0.1,
            "frequency_penalty": -0.2,
            "repetition_penalty": 1.1,
            "seed": 7,
            "stop_token_ids": [5],
            "min_tokens": 2,
            "logprobs": 0,
            "ignore_eos": True,
        }
    )
    assert sampling_params(req, 9) == SamplingParams(
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.1,
        frequency_penalty=-0.2,
        repetition_penalty=1.1,
        seed=7,
        stop_token_ids=[5],
        min_tokens=2,
        logprobs=0,
        ignore_eos=True,
    )


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"temperature": -1.0}, "temperature", "temperature must be >= 0, got -1.0"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        (
            {"max_completion_tokens": 0},
            "max_completion_tokens",
            "max_tokens must be at least 1, got 0",
        ),
        ({"min_tokens": 9}, "min_tokens", "min_tokens (9) must not exceed max_tokens (3)"),
    ],
)
def test_sampling_errors_name_the_field(fields: dict, param: str, message: str) -> None:
    req = chat().model_copy(update=fields)  # past the request model's own range checks
    with pytest.raises(OpenAIError) as info:
        sampling_params(req, req.requested_max_tokens() if "max_completion_tokens" in fields else 3)
    assert info.value.body() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ],
)
def test_unsupported_fields_are_refused(fields: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        check_supported(chat(**fields))
    assert (info.value.status, info.value.param) == (400, param)


def test_error_param_paths() -> None:
    assert error_param(("body", "messages", 0, "role")) == "messages[0].role"
    assert error_param(("body", "stop", "list[str]", 4)) == "stop"
    assert error_param(("body", "prompt", "str")) == "prompt"
    assert error_param(("body",)) is None


@pytest.mark.parametrize(
    ("model", "body", "param", "message"),
    [
        (ChatCompletionRequest, {"model": "m", "messages": [], "n": 1}, "messages",
         "messages: List should have at least 1 item after validation, not 0"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
         "messages[0].role",
         "messages[0].role: Input should be 'system', 'user', 'assistant', 'tool' or 'developer'"),
        (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}], "n": 17}, "n",
         "n: Input should be less than or equal to 16"),
        (CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 21}, "logprobs",
         "logprobs: Input should be less than or equal to 20"),
        (CompletionRequest, {"prompt": "x"}, "model", "model: Field required"),
    ],
)  # fmt: skip
def test_validation_errors_become_openai_bodies(
    model: type, body: dict, param: str, message: str
) -> None:
    error = from_validation(validation_error(model, body))
    assert error.body() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    }


def test_too_many_stop_strings() -> None:
    body = {"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}
    error = from_validation(validation_error(CompletionRequest, body))
    assert (error.status, error.param) == (400, "stop")


def test_model_not_found_body() -> None:
    assert model_not_found("gpt-9").body() == {
        "error": {
            "message": "The model `gpt-9` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert model_not_found("gpt-9").status == 404


def test_prepare_chat_applies_the_template(tokenizer: Tokenizer) -> None:
    req = chat(stream=True, stream_options={"include_usage": True}, stop=["x", ""])
    job = prepare_chat(req, tokenizer, MODEL)
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    [request] = job.requests
    assert request.prompt_token_ids == ids
    assert request.request_id == job.response_id
    assert job.response_id.startswith("chatcmpl-") and len(job.response_id) == 9 + 32
    assert request.sampling == SamplingParams(max_tokens=MODEL.max_model_len - len(ids))  # all room
    assert (job.kind, job.n, job.stops, job.include_usage, job.logprobs) == (
        "chat", 1, ["x"], True, False,
    )  # fmt: skip


def test_prepare_chat_context_length(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(OpenAIError) as info:
        prepare_chat(chat(max_tokens=64), tokenizer, MODEL)
    assert info.value.body()["error"] == {
        "message": f"This model's maximum context length is 64 tokens. However, you requested "
        f"{len(ids) + 64} tokens ({len(ids)} in the messages, 64 in the completion). "
        "Please reduce the length of the messages or completion.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }


def test_prepare_completion_prompt_forms(tokenizer: Tokenizer) -> None:
    def prompts(prompt: object) -> list[list[int]]:
        req = CompletionRequest.model_validate({"model": "tiny", "prompt": prompt})
        return [r.prompt_token_ids for r in prepare_completion(req, tokenizer, MODEL).requests]

    hello = tokenizer.encode("hello")
    assert hello[0] == tokenizer.bos_token_id
    assert prompts("hello") == [hello]
    assert prompts(["hello", "hi"]) == [hello, tokenizer.encode("hi")]
    assert prompts([5, 6, 7]) == [[5, 6, 7]]
    assert prompts([[5], [6, 7]]) == [[5], [6, 7]]
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": ["a", "b"], "n": 2})
    job = prepare_completion(req, tokenizer, MODEL)
    assert [r.request_id for r in job.requests] == [f"{job.response_id}-0", f"{job.response_id}-1"]
    assert job.num_choices == 4
    assert [r.sampling.max_tokens for r in job.requests] == [16, 16]


@pytest.mark.parametrize(
    ("prompt", "extra", "param"),
    [
        ([], {}, "prompt"),
        ([[]], {}, "prompt"),
        ([5, 99999], {}, "prompt"),
        ("x", {"stop_token_ids": [-1]}, "stop_token_ids"),
        ("x", {"echo": True, "n": 2}, "echo"),
        ("x", {"max_tokens": 0}, "max_tokens"),
        (list(range(64)), {}, "prompt"),
    ],
)
def test_prepare_completion_refusals(
    tokenizer: Tokenizer, prompt: object, extra: dict, param: str
) -> None:
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": prompt, **extra})
    with pytest.raises(OpenAIError) as info:
        prepare_completion(req, tokenizer, MODEL)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"echo": True, "logprobs": 20}, "logprobs"), ({"prompt_logprobs": 20}, "prompt_logprobs")],
)
def test_prompt_scores_past_their_bound_are_refused(
    tokenizer: Tokenizer, extra: dict, param: str
) -> None:
    """(prompt tokens - 1) x (k + 1) entries at most: 3,121 tokens with 20 alternatives."""
    model = served_model("tiny", max_model_len=8192)
    body = {"model": "tiny", "max_tokens": 0, **extra}
    ok = CompletionRequest.model_validate({**body, "prompt": [7] * 3121})
    assert prepare_completion(ok, tokenizer, model).requests[0].sampling.prompt_logprobs == 20
    req = CompletionRequest.model_validate({**body, "prompt": [7] * 3122})
    with pytest.raises(OpenAIError) as info:
        prepare_completion(req, tokenizer, model)
    assert (info.value.status, info.value.param) == (400, param)
    assert "over the limit of 65536" in info.value.message
