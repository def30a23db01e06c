"""``/livez`` and ``/readyz`` for the roles that serve no HTTP of their own (the coordinator and
the workers; the gateway has ``/health``): a tiny server on a thread of its own, for probes::

    GET /livez   200 "ok": the role's loop comes round; 503 and why once it has stalled
    GET /readyz  200 "ok": the role should be given work; 503 and why not
    any other path 404, any other method 405; HEAD answers as GET without the body

Bounded: one request at a time, read up to the end of its head (at most ``MAX_HEAD_BYTES``,
no body) within ``REQUEST_TIMEOUT_S`` in all, answered and closed. A probe is a plain function
of the role (``Probe``: None when healthy, else the reason); it runs on this thread, so it only
reads attributes the role's loop writes whole (as ``runtime/liveness.py`` does).
"""

from __future__ import annotations

import argparse
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from http import HTTPStatus

log = logging.getLogger(__name__)

LIVEZ = "/livez"
READYZ = "/readyz"
REQUEST_TIMEOUT_S = 2.0  # a request's whole head must arrive within this
MAX_HEAD_BYTES = 8192  # request line and headers; a longer head is refused

Probe = Callable[[], str | None]  # None: healthy; otherwise why not


def add_health_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--health-port",
        type=int,
        default=0,
        help=f"serve {LIVEZ} and {READYZ} over HTTP on this port, for probes (0: none)",
    )
    parser.add_argument(
        "--health-host",
        default="127.0.0.1",
        help="address the health port listens on (0.0.0.0: every interface, for a kubelet)",
    )


class LoopTicks:
    """When a loop last came round (its thread writes one float, the probes read it):
    live while it came round within ``stall_s``, ready once it has and within ``ready_s``."""

    def __init__(
        self, stall_s: float, ready_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stall_s = stall_s
        self.ready_s = ready_s
        self._clock = clock
        self._since = clock()  # before the first tick, quiet counts from here
        self.last: float | None = None

    def tick(self, now: float) -> None:
        self.last = now

    def livez(self) -> str | None:
        quiet = self._clock() - (self._since if self.last is None else self.last)
        return f"the loop has not come round for {quiet:.1f}s" if quiet > self.stall_s else None

    def readyz(self) -> str | None:
        last = self.last
        if last is None:
            return "the loop has not come round yet"
        quiet = self._clock() - last
        return f"the loop has not come round for {quiet:.1f}s" if quiet > self.ready_s else None


class HealthServer:
    """The HTTP server and its thread: bound when made (``OSError`` if it cannot be), serving
    from ``start`` until ``close``."""

    def __init__(self, host: str, port: int, livez: Probe, readyz: Probe) -> None:
        self._server = _Server((host, port), {LIVEZ: livez, READYZ: readyz})
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.2,), name="health-http", daemon=True
        )

    @property
    def port(self) -> int:
        port: int = self._server.server_address[1]
        return port

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("health probes on port %d: %s %s", self.port, LIVEZ, READYZ)
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()


def start_health(args: argparse.Namespace, livez: Probe, readyz: Probe) -> HealthServer | None:
    """The server ``--health-port`` asks for, started; None for port 0. ``SystemExit`` when the
    port cannot be bound (a start-up error, like any other address)."""
    if not args.health_port:
        return None
    if not 0 < args.health_port < 65536:
        raise SystemExit(f"--health-port must be in 1..65535 (0: none), got {args.health_port}")
    try:
        return HealthServer(args.health_host, args.health_port, livez, readyz).start()
    except OSError as e:
        where = f"{args.health_host}:{args.health_port}"
        raise SystemExit(f"cannot serve health probes on {where}: {e}") from None


class _Server(socketserver.TCPServer):
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], probes: dict[str, Probe]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.probes = probes
        super().__init__(address, _Handler)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server
    request: socket.socket

    def handle(self) -> None:
        try:
            head = _read_head(self.request, time.monotonic() + REQUEST_TIMEOUT_S)
        except (OSError, ValueError):  # timed out, reset, or too long: nothing to answer
            return
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0].decode("latin-1")
        status, text = self._answer(method, path)
        body = (text + "\n").encode()
        lines = [
            f"HTTP/1.1 {status.value} {status.phrase}",
            "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(body)}",
            "Connection: close",
        ]
        out = "\r\n".join(lines).encode() + b"\r\n\r\n"
        self.request.settimeout(REQUEST_TIMEOUT_S)
        self.request.sendall(out if method == b"HEAD" else out + body)

    def _answer(self, method: bytes, path: str) -> tuple[HTTPStatus, str]:
        probe = self.server.probes.get(path)
        if probe is None:
            return HTTPStatus.NOT_FOUND, "not found"
        if method not in (b"GET", b"HEAD"):
            return HTTPStatus.METHOD_NOT_ALLOWED, "GET only"
        try:
            reason = probe()
        except Exception as e:  # a probe that fails says so; the server goes on
            log.exception("health probe %s failed", path)
            reason = f"the probe failed: {e}"
        return (HTTPStatus.OK, "ok") if reason is None else (HTTPStatus.SERVICE_UNAVAILABLE, reason)


def _read_head(sock: socket.socket, deadline: float) -> bytes:
    """The request line of a request whose head (up to the blank line) arrived by
    ``deadline``; ``OSError`` (a timeout) or ``ValueError`` (too long, or cut short)."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            raise ValueError("request head too long")
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(4096)
        if not chunk:
            raise ValueError("the request ended before its head did")
        data += chunk
    return data.split(b"\r\n", 1)[0]
