"""``pdserve gateway``: the OpenAI HTTP server in front of a coordinator.

The gateway learns its models from the coordinator's ``ClusterState``; each model's tokenizer is
read from its root directory (a shared filesystem) the first time a request or ``/v1/models``
needs it (``api_extras.LazyTokenizers``). Never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from pdserve import envs
from pdserve.gateway.api_extras import LazyTokenizers
from pdserve.gateway.app import create_app
from pdserve.gateway.chat_template import tokenizer_loader
from pdserve.gateway.config import GatewayConfig, add_config_args, config_from_args
from pdserve.gateway.drain import SHUTDOWN_GRACE_S, DrainingServer
from pdserve.gateway.http_limits import header_deadline_protocol
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.tenancy.args import add_tenancy_args, tenancy_from_args
from pdserve.gateway.tenancy.core import Tenancy
from pdserve.gateway.zmq_backend import ZmqBackend
from pdserve.runtime.tracing import NO_TRACER, Tracer, add_otlp_args, tracer_from_args

log = logging.getLogger(__name__)

COORDINATOR_ENV = "PDSERVE_COORDINATOR"  # the coordinator's inbox address
LOG_LEVELS = ("debug", "info", "warning", "error")
KEEP_ALIVE_S = 5.0  # an idle kept-alive connection is closed after this long


def gateway_app(
    backend: ZmqBackend,
    config: GatewayConfig | None = None,
    tenancy: Tenancy | None = None,
    tracer: Tracer = NO_TRACER,
) -> FastAPI:
    """The HTTP app over ``backend``, which starts and stops with the server; SIGHUP reloads
    the tenants file, and the usage record is written out at the end (and ``tracer``'s spans
    sent)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        if tenancy is not None:
            loop.add_signal_handler(signal.SIGHUP, tenancy.reload)
        await backend.start()
        try:
            yield
        finally:
            await backend.close()
            if tenancy is not None:
                loop.remove_signal_handler(signal.SIGHUP)
                await asyncio.to_thread(tenancy.close)
            await asyncio.to_thread(tracer.close)

    template = config.chat_template if config is not None else None
    tokenizers = LazyTokenizers(backend.model_roots, tokenizer_loader(template))
    metrics = GatewayMetrics()
    backend.samples = metrics.samples.drain  # each hello takes the planner's samples
    app = create_app(
        backend, tokenizers, metrics=metrics, lifespan=lifespan, config=config, tenancy=tenancy
    )
    app.state.gateway.tracer = tracer
    return app


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    coordinator = envs.coordinator_address()
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free one)")
    parser.add_argument(
        "--coordinator",
        default=coordinator,
        required=coordinator is None,
        help=f"the coordinator's inbox address, e.g. tcp://10.0.0.5:7000 (env {COORDINATOR_ENV})",
    )
    parser.add_argument(
        "--stream-bind",
        default="tcp://127.0.0.1:0",
        help="where workers send this gateway's tokens (port 0: any free one); "
        "use an address the workers can reach",
    )
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times one choice may resume on another worker after its worker died mid-stream",
    )
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    add_config_args(parser)
    add_tenancy_args(parser)
    add_otlp_args(parser)


def http_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def http_limits(config: GatewayConfig) -> dict[str, Any]:
    """uvicorn's share of the gateway's bounds: the header deadline, the connection cap, the
    keep-alive idle time."""
    return {
        "http": header_deadline_protocol(config.header_timeout_s),
        "limit_concurrency": config.max_connections,
        "timeout_keep_alive": KEEP_ALIVE_S,
    }


def run_gateway(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT, then drain (``gateway.drain``) and return 0; SIGHUP
    reloads the tenants file (ignored until the server runs)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        config = config_from_args(args)
        tenancy = tenancy_from_args(args, config.api_keys)
    except ValueError as e:
        log.error("%s", e)
        return 2
    try:
        sock = http_socket(args.host, args.port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        tenancy.close()
        return 1
    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    backend = ZmqBackend(args.coordinator, args.stream_bind, max_migrations=args.max_migrations)
    app = gateway_app(backend, config, tenancy, tracer_from_args(args, "pdserve-gateway"))
    uvicorn_config = uvicorn.Config(
        app,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        **http_limits(config),
    )
    server = DrainingServer(uvicorn_config, app.state.admission, config.drain_timeout_s)
    tenants = tenancy.tenants
    keys = f", {len(tenants)} tenant(s), {tenants.key_count} key(s)" if tenants else ", no API key"
    log.info("gateway at %s/v1, coordinator %s%s", url, args.coordinator, keys)
    print(f"pdserve gateway: {url}", flush=True)
    with sock:
        server.run(sockets=[sock])
    return 0 if server.started else 1
