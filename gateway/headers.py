"""Headers on every answer: ``X-Request-Id``, and CORS where ``--allowed-origins`` asks for it.

``X-Request-Id`` is the client's when it sent a sane one (1 to 128 visible ASCII characters),
else a fresh one; every response carries it, the admission's refusals included, and the app
finds it in ``request.state.request_id`` for its logs (and when the request came, before any
other middleware, in ``request.state.arrived``: its gateway_queue phase starts there). It is
not the response's ``id``: that stays the gateway's own, unique across the cluster whatever
clients send.

CORS is off unless origins are given (vLLM allows every origin by default; here a browser page
from elsewhere cannot read a local server's answers unless asked). A preflight is answered
before the API key check, as vLLM does: it carries no key.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.gateway.config import GatewayConfig

REQUEST_ID = b"x-request-id"
ARRIVED = "arrived"  # ``request.state.arrived``: time.monotonic() when the request came
MAX_REQUEST_ID_CHARS = 128


def request_id(given: bytes | None) -> str:
    """``given`` if it is 1 to 128 visible ASCII characters, else a new uuid4 hex."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and all(0x21 <= b <= 0x7E for b in given):
        return given.decode("ascii")
    return uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == REQUEST_ID), None)
        rid = request_id(given)
        scope.setdefault("state", {}).update(request_id=rid, arrived=time.monotonic())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID]
                message = {**message, "headers": [*headers, (REQUEST_ID, rid.encode("ascii"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def add_header_middleware(app: FastAPI, config: GatewayConfig) -> None:
    """Add after every other middleware: these wrap them all (a refusal gets the headers too)."""
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods),
            allow_headers=list(config.allowed_headers),
            allow_credentials=config.allow_credentials,
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(RequestIdMiddleware)
