"""What a request must pass before the app sees it, as one ASGI middleware::

    /v1/*, /tokenize, /detokenize  API key: its tenant (401)  ->  not draining (503)
    POST /v1/{chat/,}completions   JSON content type (415)  ->  body within the limit (413)
         /v1/responses             and the body timeout (408), read here and replayed
         /tokenize, /detokenize    ->  in-flight slot (429; generation only)

The key's tenant (``gateway.tenancy``) goes in ``request.state.tenant`` for the app, which
admits the request against that tenant's rate limits once its prompt is tokenized.
Every refusal is an OpenAI error body, logged; 429 and 503 carry ``Retry-After``. The slot is
taken once the body is in: a client that sends its body slowly holds a connection (bounded by
the server's connection cap and the body timeout), never a slot. A generation request holds its
slot until its response (a whole stream) has been sent, so the in-flight count is what a
graceful drain waits for. ``/health``, ``/metrics``, ``/version`` and ``/openapi.json`` stay
open. (vLLM leaves ``/tokenize`` open too; here it costs tokenizer time, so it takes the key:
``vllm bench serve`` then skips its prompt re-alignment, saying so.)
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.errors import (
    OpenAIError,
    body_timeout,
    body_too_large,
    draining,
    error_response,
    overloaded,
    unsupported_media_type,
)
from pdserve.gateway.metrics import Outcome
from pdserve.gateway.run import JobRun
from pdserve.gateway.tenancy.core import TENANT, Tenancy

log = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
TOKENIZE_PATHS = ("/tokenize", "/detokenize")  # bodies bounded like generation's, no slot
EMBED_PATHS = ("/v1/embeddings",)  # bounded, and a slot each, like generation


class AdmissionState:
    """Per app: requests in flight, the drain flag, and the runs a drain may end."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.draining = False
        self.runs: weakref.WeakSet[JobRun] = weakref.WeakSet()

    def expire_all(self, error: OpenAIError) -> int:
        """End every running job with ``error`` (an SSE error event, or the status)."""
        live = [run for run in self.runs if not run.closed]
        for run in live:
            run.expire(error, Outcome.ABORTED)
        return len(live)


def bearer_token(scope: Scope) -> bytes | None:
    """The token of ``Authorization: Bearer <token>``; empty for another scheme, None without
    the header."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), None)


class Admission:
    """The middleware that gates every request (module docstring); it owns no state but the
    app's ``AdmissionState``; ``tenancy`` knows the keys."""

    def __init__(
        self,
        app: ASGIApp,
        config: GatewayConfig,
        state: AdmissionState,
        tenancy: Tenancy,
        on_reject: Callable[[str, OpenAIError], None] | None = None,
    ) -> None:
        self.app = app
        self.config = config
        self.state = state
        self.tenancy = tenancy
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        gated = path == "/v1" or path.startswith("/v1/") or path in TOKENIZE_PATHS
        error = self._gate(scope) if gated else None
        slot = path in GENERATE_PATHS or path in EMBED_PATHS
        if error is None and (slot or path in TOKENIZE_PATHS):
            await self._generate(scope, receive, send, slot=slot)
            return
        if error is not None:
            await self._reject(error, scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _gate(self, scope: Scope) -> OpenAIError | None:
        tenant = self.tenancy.authenticate(bearer_token(scope))
        if isinstance(tenant, OpenAIError):
            return tenant
        scope.setdefault("state", {})[TENANT] = tenant
        return draining() if self.state.draining else None

    async def _generate(self, scope: Scope, receive: Receive, send: Send, slot: bool) -> None:
        if scope["method"] != "POST":
            await self.app(scope, receive, send)  # the router answers 405
            return
        body = None
        error = _content_type_error(_header(scope, b"content-type"))
        if error is None:
            try:
                async with asyncio.timeout(self.config.body_timeout_s):
                    body, error = await self._read_body(scope, receive)
            except TimeoutError:
                error = body_timeout(self.config.body_timeout_s)
        if error is None and body is None:
            return  # the client left while sending its body: nobody to answer
        if error is None and self.state.draining:
            error = draining()
        if slot and error is None and self.state.in_flight >= self.config.max_pending_requests:
            error = overloaded(self.config.max_pending_requests)
        if error is not None:
            await self._reject(error, scope, receive, send)
            return
        if not slot:
            await self.app(scope, _replay(body or b"", receive), send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, _replay(body or b"", receive), send)
        finally:
            self.state.in_flight -= 1

    async def _read_body(
        self, scope: Scope, receive: Receive
    ) -> tuple[bytes | None, OpenAIError | None]:
        limit = self.config.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None, body_too_large(limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None, body_too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    async def _reject(self, error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client") or ("?", 0)
        log.info(
            "%s %s from %s:%s refused: %d %s",
            scope["method"],
            scope["path"],
            client[0],
            client[1],
            error.status,
            error.message,
        )
        if self.on_reject is not None:
            self.on_reject(scope["path"], error)
        await error_response(error)(scope, receive, send)


def _content_type_error(content_type: str | None) -> OpenAIError | None:
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type == "application/json":
        return None
    return unsupported_media_type(content_type or "")


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read here, then the client's own messages (a disconnect, for the app)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Any:
        return pending.pop() if pending else await receive()

    return replayed
