"""The HTTP layer: one handler per endpoint; the work is in ``jobs``, ``generation``, ``stream``,
``api_extras``.

POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /v1/models/{id}
POST /tokenize   POST /detokenize   GET /version   GET /health   GET /metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.admission import GENERATE_PATHS, Admission, AdmissionState
from pdserve.gateway.api_extras import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    model_list,
    pdserve_version,
    resolve_model,
    retrieve_model,
    system_fingerprint,
    tokenize,
)
from pdserve.gateway.backend import Backend, BackendError, ModelInfo
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import (
    OpenAIError,
    error_response,
    from_backend,
    install_error_handlers,
    model_not_found,
)
from pdserve.gateway.generation import Generation
from pdserve.gateway.headers import add_header_middleware
from pdserve.gateway.jobs import Job, prepare_chat, prepare_completion
from pdserve.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from pdserve.gateway.openai_models import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest
from pdserve.gateway.stream import BoundedStreamingResponse, collect, error_body, stream_events

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response


def request_outcome(error: OpenAIError) -> str:
    """The ``pdserve_requests_total`` outcome of a request answered with ``error``."""
    if error.status in (429, 503):
        return "rejected"
    if error.code == "timeout":
        return "timeout"
    return "error" if error.status >= 500 else "invalid"


def create_app(
    backend: Backend,
    tokenizers: Mapping[str, Tokenizer],
    *,
    metrics: GatewayMetrics | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    config: GatewayConfig | None = None,
) -> FastAPI:
    """``tokenizers`` maps each served model name to its tokenizer; a model is available once
    ``backend.models()`` lists it too. It may load them lazily: an ``OpenAIError`` raised by
    ``tokenizers.get`` answers the request. ``lifespan`` runs around the server (it starts and
    stops a backend that owns sockets). ``app.state.admission`` is the in-flight count and the
    drain flag (``gateway.drain`` drives them)."""
    metrics = metrics or GatewayMetrics()
    config = config or GatewayConfig()
    admission = AdmissionState()
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.admission = admission

    def count(path: str, error: OpenAIError) -> None:
        if path in GENERATE_PATHS:
            metrics.requests.inc(outcome=request_outcome(error))

    install_error_handlers(app, lambda request, error: count(request.url.path, error))
    app.add_middleware(Admission, config=config, state=admission, on_reject=count)
    add_header_middleware(app, config)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    aliases = dict(config.model_aliases)

    def lookup(name: str | None) -> tuple[str, Tokenizer, ModelInfo]:
        """The served model ``name`` stands for (an alias, or None for the only one)."""
        model = resolve_model(name, aliases, tokenizers)
        tokenizer = tokenizers.get(model)
        if tokenizer is None:
            raise model_not_found(model)
        info = next((m for m in backend.models() if m.id == model), None)
        if info is None:
            raise OpenAIError(503, f"model `{model}` has no workers yet", param="model")
        return model, tokenizer, info

    async def serve(job: Job, tokenizer: Tokenizer, info: ModelInfo, request: Request) -> Response:
        job = dataclasses.replace(job, system_fingerprint=system_fingerprint(info))
        if getattr(request.state, "request_id", None):
            log.debug("request %s: X-Request-Id %s", job.response_id, request.state.request_id)
        gen = Generation(
            backend,
            tokenizer,
            job,
            metrics,
            timeout_s=config.timeout_s,
            idle_s=config.idle_timeout_s,
            max_backlog=config.max_stream_backlog,
        )
        admission.generations.add(gen)
        try:
            await gen.start()
        except BackendError as e:
            error = from_backend(e)
            log.warning("request %s: refused: %d %s", job.response_id, e.status, e.message)
            raise error from e
        except OpenAIError as e:  # the request timeout passed while it was being placed
            log.warning("request %s: refused: %d %s", job.response_id, e.status, e.message)
            raise
        if job.stream:
            # The background close aborts a stream the server never began to iterate.
            return BoundedStreamingResponse(
                stream_events(gen),
                send_timeout_s=config.stream_send_timeout_s,
                on_cut=gen.close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(gen.close),
            )
        return await complete(gen, request)

    # Template and tokenizer run in a thread: a long prompt must not stall every stream (it
    # still does while the tokenizer holds the GIL).
    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model, tokenizer, info = lookup(body.model)
        body = body.model_copy(update={"model": model})  # an alias: the served name from here
        parser = config.tool_call_parser
        job = await asyncio.to_thread(prepare_chat, body, tokenizer, info, parser)
        return await serve(job, tokenizer, info, request)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model, tokenizer, info = lookup(body.model)
        body = body.model_copy(update={"model": model})
        job = await asyncio.to_thread(prepare_completion, body, tokenizer, info)
        return await serve(job, tokenizer, info, request)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize_text(body: TokenizeRequest) -> dict[str, Any]:
        _, tokenizer, info = lookup(body.model)
        return await asyncio.to_thread(tokenize, body, tokenizer, info)

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize_ids(body: DetokenizeRequest) -> dict[str, Any]:
        _, tokenizer, info = lookup(body.model)
        return await asyncio.to_thread(detokenize, body, tokenizer, info)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return model_list(backend.models(), tokenizers, aliases)

    @app.get("/v1/models/{model:path}", responses=ERROR_RESPONSES)
    async def retrieve(model: str) -> dict[str, Any]:
        return retrieve_model(model, backend.models(), tokenizers, aliases)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pdserve_version()}

    @app.get("/health")
    async def health() -> Response:
        if admission.draining:
            return error_response(OpenAIError(503, "draining", code="draining"))
        if not backend.health():
            return error_response(OpenAIError(503, "the backend is not ready"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        metrics.in_flight.set(admission.in_flight)
        text = metrics.render(backend.worker_stats(), backend.routing_decisions())
        return Response(text, media_type=CONTENT_TYPE)

    return app


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


async def complete(gen: Generation, request: Request) -> Response:
    """Run a non-streaming generation; abort it if the client leaves first."""
    work = asyncio.ensure_future(collect(gen))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        await gen.close()
    if work.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    error = work.exception()
    if error is not None:
        body = error_body(error)
        log.warning("request %s: %d %s", gen.job.response_id, body.status, body.message)
        return error_response(body)  # counted by the generation, not on_error
    return JSONResponse(work.result())


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
