"""The HTTP layer: one handler per endpoint, each a few lines over plain functions (``Gateway``
here; ``jobs``, ``run``, ``responses``, ``api_extras``)::

    POST /v1/chat/completions   POST /v1/completions   POST /v1/responses
    GET /v1/models   GET /v1/models/{id}
    POST /tokenize   POST /detokenize   GET /version   GET /health   GET /metrics

A generation request: ``Gateway.lookup`` (the model), ``jobs.prepare_*`` (the ``Job``),
``Gateway.serve`` (its ``JobRun`` started, then streamed by ``responses.stream_events`` or
collected by ``complete``; a Responses API job by ``responses_api.serve`` instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, cast

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from pdserve.engine.embed.tokenize import EmbedTokenizer
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
from pdserve.gateway.backend import Backend, BackendError
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.embeddings import (
    EmbeddingRequest,
    embedding_body,
    load_tokenizer,
    prepare_embed,
)
from pdserve.gateway.errors import (
    ERROR_RESPONSES,
    OpenAIError,
    error_body,
    error_response,
    from_backend,
    install_error_handlers,
    model_not_found,
    openapi_schema,
    request_outcome,
)
from pdserve.gateway.headers import ARRIVED, add_header_middleware
from pdserve.gateway.jobs import Job, prepare_chat, prepare_completion
from pdserve.gateway.metrics import GatewayMetrics, Outcome
from pdserve.gateway.observe.planning import planner_json
from pdserve.gateway.observe.prometheus import CONTENT_TYPE
from pdserve.gateway.observe.tracing import start_trace, with_trace
from pdserve.gateway.openai_models import ChatCompletionRequest, CompletionRequest
from pdserve.gateway.responses import BoundedStreamingResponse, collect, stream_events
from pdserve.gateway.responses_api.models import ResponsesRequest
from pdserve.gateway.responses_api.output import echo
from pdserve.gateway.responses_api.serve import ResponsesOutput
from pdserve.gateway.responses_api.translate import check_output_tokens, prepare_response
from pdserve.gateway.run import JobRun
from pdserve.gateway.tenancy.core import OPEN, RATELIMIT_HEADERS, TENANT, Tenancy
from pdserve.gateway.tenancy.request import (
    HoldListener,
    RateLimitHeaders,
    check_max_tokens,
    for_tenant,
    reserved_tokens,
)
from pdserve.gateway.tenancy.tenants import Tenant
from pdserve.gateway.versions import Versions, conversation_pin, rollout_metrics
from pdserve.protocol import messages as m
from pdserve.runtime.tracing import NO_TRACER, TRACEPARENT, Tracer

log = logging.getLogger(__name__)

Collect = Callable[[JobRun], Awaitable[dict[str, Any]]]  # a started run -> the response body
Events = Callable[[JobRun], AsyncIterator[str]]  # a started run -> its SSE body

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the response
MODEL_STATE = "pdserve_model"  # request.state: the served name (a version) it was resolved to


@dataclass
class Gateway:
    """What the handlers of one app share, and the work they do: ``tokenizers`` maps each
    served model name to its tokenizer, ``aliases`` each alias to a served name; ``admission``
    is the in-flight count and the drain flag (``gateway.drain`` drives them), and the runs a
    drain may end; ``tenancy`` the keys' tenants, their limits and their usage."""

    backend: Backend
    tokenizers: Mapping[str, Tokenizer]
    metrics: GatewayMetrics
    config: GatewayConfig
    tenancy: Tenancy
    admission: AdmissionState = dataclasses.field(default_factory=AdmissionState)
    # models served so far: one whose workers are all away (restarting, or a restarted
    # coordinator relearning them) is a retryable 503, not a 404 for a model that never was
    served: set[str] = dataclasses.field(default_factory=set)
    # embedding models' tokenizers, by name, as their workers tokenize (gateway.embeddings)
    embed_tokenizers: dict[str, EmbedTokenizer] = dataclasses.field(default_factory=dict)
    tracer: Tracer = NO_TRACER  # the requests' spans (``--otlp-endpoint``: runtime/tracing.py)

    @property
    def aliases(self) -> dict[str, str]:
        return dict(self.config.model_aliases)

    @property
    def versions(self) -> Versions:
        return Versions(self.backend.rollouts)

    def listed(self) -> dict[str, str]:
        """The names ``/v1/models`` lists beside the served ones: the aliases, and each name
        with versions (as its stable version's card)."""
        return self.aliases | self.versions.names()

    def count(self, path: str, error: OpenAIError, model: str = "") -> None:
        """Count a generation request answered with ``error`` before it ran (``model``: the
        served name it was resolved to, if it got that far)."""
        if path in GENERATE_PATHS:
            self.metrics.answered(model, request_outcome(error), error.status >= 500)

    def lookup(
        self,
        name: str | None,
        kind: str = "generate",
        *,
        request: Request | None = None,
        body: Any = None,
    ) -> tuple[str, Tokenizer, m.ServedModel]:
        """The served model ``name`` stands for (an alias, or None for the only one; a name
        with versions: the one ``body``'s conversation is pinned to, or its stable version,
        ``gateway.versions``), of ``kind``: a generation on an embedding model, or the other
        way, is a 400. The name found is noted on ``request`` (its metrics' ``model``)."""
        versions = self.versions
        pin = None if body is None or request is None else _pin(body, request)
        model = versions.pick(resolve_model(name, self.aliases, self.tokenizers), pin)
        tokenizer = self.tokenizers.get(model)
        models = self.backend.models()
        if tokenizer is None and model not in self.served and not versions.declared(model):
            if not models:  # starting, or a restarted coordinator relearning every worker
                raise OpenAIError(503, "no model has workers yet: the cluster is starting")
            raise model_not_found(model)
        if request is not None:
            setattr(request.state, MODEL_STATE, model)
        info = next((s for s in models if s.name == model), None)
        if tokenizer is None or info is None:
            raise OpenAIError(503, f"model `{model}` has no workers yet", param="model")
        self.served.add(model)
        if info.kind != kind:
            what = (
                "an embedding model: use /v1/embeddings"
                if info.kind == "embed"
                else ("a generative model: it serves no embeddings")
            )
            raise OpenAIError(400, f"model `{model}` is {what}", param="model")
        return model, tokenizer, info

    async def serve(
        self,
        job: Job,
        tokenizer: Tokenizer,
        info: m.ServedModel,
        request: Request,
        priority: int | None = 0,
        collect_body: Collect = collect,
        events: Events = stream_events,
    ) -> Response:
        """Admit ``job`` against its tenant's limits, start it (a refusal is the response's
        status), then stream it (``events``) or collect it (``collect_body``)."""
        job = dataclasses.replace(job, system_fingerprint=system_fingerprint(info))
        if getattr(request.state, "request_id", None):
            log.debug("request %s: X-Request-Id %s", job.response_id, request.state.request_id)
        tenant = tenant_of(request)
        job = for_tenant(job, tenant, priority or 0)
        hold = await self.tenancy.admit(tenant, job.model, job.response_id, *reserved_tokens(job))
        setattr(request.state, RATELIMIT_HEADERS, hold.headers)
        config = self.config
        arrived = getattr(request.state, ARRIVED, None)  # headers.RequestIdMiddleware's
        name = f"{request.method} {request.url.path}"
        trace = start_trace(self.tracer, request.headers.get(TRACEPARENT), arrived, name)
        job = with_trace(job, trace)
        run = JobRun(
            self.backend,
            tokenizer,
            job,
            self.metrics,
            timeout_s=config.timeout_s,
            idle_s=config.idle_timeout_s,
            max_backlog=config.max_stream_backlog,
            listener=HoldListener(self.tenancy, hold),
            arrived=arrived,
            trace=trace,
        )
        self.admission.runs.add(run)
        try:
            await run.start()
        except BaseException as e:
            run.end_trace(Outcome.REJECTED)
            await self.tenancy.finish(hold, Outcome.REJECTED, 0, 0, 0)
            if isinstance(e, BackendError):
                log.warning("request %s: refused: %d %s", job.response_id, e.status, e.message)
                raise from_backend(e) from e
            if isinstance(e, OpenAIError):  # the request timeout passed while it was placed
                log.warning("request %s: refused: %d %s", job.response_id, e.status, e.message)
            raise
        if not job.stream:
            return await complete(run, request, collect_body)
        # The background close aborts a stream the server never began to iterate.
        return BoundedStreamingResponse(
            events(run),
            send_timeout_s=config.stream_send_timeout_s,
            on_cut=run.close,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(run.close),
        )

    def health(self) -> Response:
        if self.admission.draining:
            return error_response(OpenAIError(503, "draining", code="draining"))
        if not self.backend.health():
            return error_response(OpenAIError(503, "the backend is not ready"))
        return JSONResponse({"status": "ok"})

    def metrics_text(self) -> Response:
        self.metrics.in_flight.set(self.admission.in_flight)
        backend = self.backend
        text = self.metrics.render(
            backend.worker_stats(), backend.routing_decisions(), backend.plans(), backend.models()
        )
        text += rollout_metrics(backend.rollouts())
        return Response(text + self.tenancy.metrics_text(), media_type=CONTENT_TYPE)


def gateway_of(request: Request) -> Gateway:
    return cast(Gateway, request.app.state.gateway)


def tenant_of(request: Request) -> Tenant:
    """The tenant the admission found for the request's key."""
    tenant = getattr(request.state, TENANT, None)
    return tenant if isinstance(tenant, Tenant) else OPEN


def _pin(body: Any, request: Request) -> Callable[[], bytes]:
    """The conversation's key, computed only for a name with versions."""
    return lambda: conversation_pin(body, tenant_of(request).name)


def model_of(request: Request) -> str:
    """The served name ``lookup`` resolved the request to ("" before it did)."""
    model = getattr(request.state, MODEL_STATE, "")
    return model if isinstance(model, str) else ""


router = APIRouter()


# Template and tokenizer run in a thread: a long prompt must not stall every stream (it still
# does while the tokenizer holds the GIL).
@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    model, tokenizer, info = gateway.lookup(body.model, request=request, body=body)
    check_max_tokens(body, tenant_of(request))
    body = body.model_copy(update={"model": model})  # an alias: the served name from here
    parser = gateway.config.tool_call_parser
    job = await asyncio.to_thread(prepare_chat, body, tokenizer, info, parser)
    return await gateway.serve(job, tokenizer, info, request, body.priority)


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    model, tokenizer, info = gateway.lookup(body.model, request=request, body=body)
    check_max_tokens(body, tenant_of(request))
    body = body.model_copy(update={"model": model})
    job = await asyncio.to_thread(prepare_completion, body, tokenizer, info)
    return await gateway.serve(job, tokenizer, info, request, body.priority)


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    gateway = gateway_of(request)
    model, tokenizer, info = gateway.lookup(body.model, request=request, body=body)
    check_output_tokens(body, tenant_of(request))
    body = body.model_copy(update={"model": model})
    parser = gateway.config.tool_call_parser
    job = await asyncio.to_thread(prepare_response, body, tokenizer, info, parser)
    output = ResponsesOutput(echo(body))
    return await gateway.serve(
        job, tokenizer, info, request, body.priority, output.collect, output.events
    )


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize_text(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    _, tokenizer, info = gateway_of(request).lookup(body.model)
    return await asyncio.to_thread(tokenize, body, tokenizer, info)


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize_ids(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    _, tokenizer, info = gateway_of(request).lookup(body.model)
    return await asyncio.to_thread(detokenize, body, tokenizer, info)


@router.post("/v1/embeddings", responses=ERROR_RESPONSES)
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    model, _, info = gateway.lookup(body.model, kind="embed")
    tokenizer = gateway.embed_tokenizers.get(model)
    if tokenizer is None:
        tokenizer = gateway.embed_tokenizers[model] = load_tokenizer(info)
    embed = await asyncio.to_thread(prepare_embed, body, tokenizer, info)
    tokens = sum(len(ids) for ids in embed.inputs)
    tenancy = gateway.tenancy
    hold = await tenancy.admit(tenant_of(request), model, embed.request_id, tokens, 0)
    setattr(request.state, RATELIMIT_HEADERS, hold.headers)
    try:
        result = await gateway.backend.embed(embed, gateway.config.timeout_s)
    except BackendError as e:
        await tenancy.finish(hold, Outcome.REJECTED, 0, 0, 0)
        raise from_backend(e) from e
    except BaseException:
        await tenancy.finish(hold, Outcome.ABORTED, 0, 0, 0)
        raise
    await tenancy.finish(hold, Outcome.SUCCESS, result.num_tokens, 0, 0)
    return await asyncio.to_thread(embedding_body, result, model, body.encoding_format)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    return model_list(gateway.backend.models(), gateway.tokenizers, gateway.listed())


@router.get("/v1/models/{model:path}", responses=ERROR_RESPONSES)
async def retrieve(model: str, request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    return retrieve_model(model, gateway.backend.models(), gateway.tokenizers, gateway.listed())


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": pdserve_version()}


@router.get("/health")
async def health(request: Request) -> Response:
    return gateway_of(request).health()


@router.get("/metrics")
async def metrics_text(request: Request) -> Response:
    return gateway_of(request).metrics_text()


@router.get("/planner")
async def planner(request: Request) -> dict[str, Any]:
    """The planner's latest plan per model and the figures it read (``gateway.planning``)."""
    return planner_json(gateway_of(request).backend.plans())


def create_app(
    backend: Backend,
    tokenizers: Mapping[str, Tokenizer],
    *,
    metrics: GatewayMetrics | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
    config: GatewayConfig | None = None,
    tenancy: Tenancy | None = None,
) -> FastAPI:
    """``tokenizers`` maps each served model name to its tokenizer; a model is available once
    ``backend.models()`` lists it too. It may load them lazily: an ``OpenAIError`` raised by
    ``tokenizers.get`` answers the request. ``lifespan`` runs around the server (it starts and
    stops a backend that owns sockets). ``app.state.admission`` is the in-flight count and the
    drain flag (``gateway.drain`` drives them). ``tenancy``: the keys' tenants (default: the
    config's API keys as one unlimited tenant, or an open API without them)."""
    config = config or GatewayConfig()
    tenancy = tenancy or Tenancy(api_keys=config.api_keys)
    gateway = Gateway(backend, tokenizers, metrics or GatewayMetrics(), config, tenancy)
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway
    app.state.admission = gateway.admission
    install_error_handlers(
        app, lambda request, error: gateway.count(request.url.path, error, model_of(request))
    )
    app.add_middleware(RateLimitHeaders, tenancy=tenancy, paths=GENERATE_PATHS)
    app.add_middleware(
        Admission,
        config=config,
        state=gateway.admission,
        tenancy=tenancy,
        on_reject=gateway.count,
    )
    add_header_middleware(app, gateway.config)
    app.openapi = lambda: openapi_schema(app)  # type: ignore[method-assign]
    app.include_router(router)
    return app


async def complete(run: JobRun, request: Request, collect_body: Collect = collect) -> Response:
    """Run a non-streaming job; abort it if the client leaves first."""
    work = asyncio.ensure_future(collect_body(run))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
        await run.close()
    if work.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    error = work.exception()
    if error is not None:
        body = error_body(error)
        log.warning("request %s: %d %s", run.job.response_id, body.status, body.message)
        return error_response(body)  # counted by the run, not on_error
    return JSONResponse(work.result())


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
