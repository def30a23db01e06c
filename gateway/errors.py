"""OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}`` and their statuses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.backend import BackendError

_CODES = {429: "rate_limit_exceeded", 503: "service_unavailable", 500: "internal_error"}


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code if code is not None else _CODES.get(status)

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


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


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
        return respond(request, OpenAIError(exc.status_code, str(exc.detail)))

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, internal(exc))

    app.add_exception_handler(OpenAIError, on_openai)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_crash)
