"""OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}`` and their statuses
(``ErrorResponse``, ``ERROR_RESPONSES``: the same, as the OpenAPI schema documents them).

Every 429 and 503 carries ``Retry-After`` (seconds), so clients and load balancers back off.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.gateway.backend import BackendError
from pdserve.gateway.metrics import Outcome

_CODES = {429: "rate_limit_exceeded", 503: "service_unavailable", 500: "internal_error"}
RETRY_AFTER_S = 1


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-200 answer of the API."""

    error: ErrorDetail


_ERROR_STATUSES = {
    400: "Invalid request (including a prompt or max_tokens beyond the model's context)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body too large",
    415: "Content type is not application/json",
    429: "Overloaded; see Retry-After",
    500: "Internal error",
    503: "Unavailable or draining; see Retry-After",
    504: "The request timed out (--request-timeout) and was aborted",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in _ERROR_STATUSES.items()
}


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code if code is not None else _CODES.get(status)
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def model_not_found(model: str) -> OpenAIError:
    message = f"The model `{model}` does not exist."
    return OpenAIError(404, message, param="model", code="model_not_found")


def invalid_api_key(given: bool) -> OpenAIError:
    message = (
        "Incorrect API key provided."
        if given
        else "Missing API key: send it as 'Authorization: Bearer <key>'."
    )
    return OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int) -> OpenAIError:
    message = f"The request body is larger than this server's limit of {limit} bytes."
    return OpenAIError(413, message, code="request_too_large")


def unsupported_media_type(content_type: str) -> OpenAIError:
    """vLLM's answer to a body that is not ``application/json``."""
    got = f"'{content_type}'" if content_type else "no content type"
    message = f"Unsupported Media Type: only 'application/json' is allowed, got {got}."
    return OpenAIError(415, message, code="unsupported_media_type")


def overloaded(limit: int) -> OpenAIError:
    message = f"The server is overloaded ({limit} requests in flight); retry later."
    return OpenAIError(429, message)


def draining() -> OpenAIError:
    return OpenAIError(503, "The server is draining: it takes no new requests.")


def request_timeout(seconds: float) -> OpenAIError:
    """504, as a proxy answers an upstream that took too long; the generation is aborted."""
    message = f"The request did not finish within the server's request timeout ({seconds:g} s)."
    return OpenAIError(504, message, code="timeout")


def stream_idle(seconds: float) -> OpenAIError:
    """504: the cluster sent nothing for this request for too long; it is aborted."""
    message = f"No progress from the cluster for {seconds:g} s: the request was ended."
    return OpenAIError(504, message, code="timeout")


def slow_reader(what: str) -> OpenAIError:
    """The client did not read its stream fast enough (it is cut off)."""
    return OpenAIError(408, f"The client read the stream too slowly ({what}).", code="slow_reader")


def body_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        408, f"The request body did not arrive within {seconds:g} s.", code="timeout"
    )


def from_backend(error: BackendError) -> OpenAIError:
    status = error.status if error.status in (400, 404, 429, 500, 503) else 500
    code = "model_not_found" if status == 404 else None
    return OpenAIError(status, error.message, code=code)


def internal(error: BaseException) -> OpenAIError:
    return OpenAIError(500, f"internal error: {type(error).__name__}: {error}")


def error_param(loc: Sequence[str | int]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; stops at union branch tags
    such as ``"list[int]"`` or ``"str"`` that pydantic puts in the location."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _BRANCH_TAGS:
            param += f".{part}" if param else part
        else:
            break
    return param or None


_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def from_validation(error: RequestValidationError) -> OpenAIError:
    errors = error.errors()
    if not errors:
        return invalid_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return invalid_request(f"request body is not valid JSON: {first.get('msg', '')}")
    param = error_param(first.get("loc", ()))
    message = first.get("msg", "invalid value")
    if param is not None:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return invalid_request(message, param)


class _ErrorJSON(JSONResponse):
    """ASCII JSON: a message that echoes a lone surrogate from the request still encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(error: OpenAIError) -> JSONResponse:
    return _ErrorJSON(error.body(), status_code=error.status, headers=error.headers)


def install_error_handlers(
    app: FastAPI, on_error: Callable[[Request, OpenAIError], None] | None = None
) -> None:
    """Every error leaves as an OpenAI body; ``on_error`` sees each one (for metrics)."""

    def respond(request: Request, error: OpenAIError) -> JSONResponse:
        if on_error is not None:
            on_error(request, error)
        return error_response(error)

    async def on_openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return respond(request, exc)

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, from_validation(exc))

    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            return respond(
                request, invalid_request(f"request body is not valid UTF-8: {exc.__cause__}")
            )
        return respond(request, OpenAIError(exc.status_code, str(exc.detail)))

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, internal(exc))

    app.add_exception_handler(OpenAIError, on_openai)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_crash)


def request_outcome(error: OpenAIError) -> Outcome:
    """The ``pdserve_requests_total`` outcome of a request answered with ``error``."""
    if error.status in (429, 503):
        return Outcome.REJECTED
    if error.code == "timeout":
        return Outcome.TIMEOUT
    return Outcome.ERROR if error.status >= 500 else Outcome.INVALID


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without the 422 it documents for every body: errors here are 400s with
    an OpenAI body (``ERROR_RESPONSES``)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def error_body(error: BaseException) -> OpenAIError:
    """What a failure says to the client: its own error, the cluster's, or a 500."""
    if isinstance(error, OpenAIError):
        return error
    return from_backend(error) if isinstance(error, BackendError) else internal(error)
