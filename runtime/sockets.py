"""Small pyzmq helpers: sockets from address strings, typed send/recv, address builders.

Addresses come from config. Local ones carry a per-launch run id so two launches on one
machine never collide: ``ipc_address(run_dir, f"coordinator-{run_id}")``.
"""

from __future__ import annotations

import logging
import secrets
import socket as pysocket
from pathlib import Path
from typing import TypeVar

import zmq

from pdserve.protocol.checks import ProtocolError
from pdserve.protocol.codec import Message, decode, encode
from pdserve.runtime.security import security_of

log = logging.getLogger(__name__)

_MAX_IPC_PATH = 107  # sun_path is 108 bytes on Linux, NUL included

# The largest control message a socket takes (a bigger one is refused by zmq before it is
# buffered whole): a prompt of 1M tokens is about 5 MB of msgpack. KV sockets set their own.
CONTROL_MAX_MSG_BYTES = 8 << 20

# a sync socket (every role's) or an asyncio one (the gateway's), as its context makes them
S = TypeVar("S", bound="zmq.Socket[object]")


def new_run_id() -> str:
    """A short random suffix for one launch's socket names."""
    return secrets.token_hex(4)


def ipc_address(run_dir: str | Path, name: str) -> str:
    path = Path(run_dir) / f"{name}.sock"
    if len(str(path).encode()) > _MAX_IPC_PATH:
        raise ValueError(f"ipc path {str(path)!r} is longer than {_MAX_IPC_PATH} bytes")
    return f"ipc://{path}"


def tcp_address(host: str, port: int) -> str:
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in [0, 65535], got {port}")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for tests; binding to ``:*`` avoids the race elsewhere)."""
    with pysocket.socket(pysocket.AF_INET, pysocket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def make_socket(
    ctx: zmq.Context[S],
    kind: int,
    address: str,
    *,
    bind: bool,
    linger_ms: int = 0,
    options: dict[int, int] | None = None,
    max_msg_bytes: int = CONTROL_MAX_MSG_BYTES,
) -> S:
    """A ``kind`` socket bound or connected to ``address``, taking no inbound frame over
    ``max_msg_bytes`` (-1: no limit); CURVE-secured when ``ctx`` is a secure context.

    A bound ``tcp://host:*`` (or ``:0``) picks a free port: read it back with ``bound_address``.
    """
    sock = ctx.socket(kind)
    # every option before bind/connect: zmq applies them to connections made afterwards only
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    security = security_of(ctx)
    if security is not None:
        security.secure(sock, bind=bind)
    try:
        if bind:
            tcp_any = address.startswith("tcp://") and address.endswith(":0")
            sock.bind(address[:-2] + ":*" if tcp_any else address)
        else:
            sock.connect(address)
    except zmq.ZMQError as exc:
        sock.close()
        verb = "bind" if bind else "connect"
        raise OSError(f"cannot {verb} {zmq.SocketType(kind).name} to {address}: {exc}") from exc
    return sock


def bound_address(sock: zmq.Socket[object]) -> str:
    """The address a socket actually bound to (port resolved)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def send_msg(
    sock: zmq.SyncSocket, msg: Message, *, identity: bytes | None = None, flags: int = 0
) -> None:
    """Send ``msg`` as one multipart message (to ``identity`` on a ROUTER socket)."""
    frames = encode(msg)
    sock.send_multipart(frames if identity is None else [identity, *frames], flags=flags)


def recv_msg(sock: zmq.SyncSocket, timeout_ms: int | None = None) -> Message | None:
    """The next message, or None on timeout or on a malformed one (logged, dropped)."""
    got = _recv(sock, timeout_ms, routed=False)
    return None if got is None else got[1]


def recv_from(sock: zmq.SyncSocket, timeout_ms: int | None = None) -> tuple[str, Message] | None:
    """(sender's ``User-Id``, message): the sender's z85 public key on a CURVE socket, "" on
    an insecure one; None on timeout or a bad message."""
    if timeout_ms is not None and not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    frames = sock.recv_multipart(copy=False)
    try:
        return sender_of(frames[0]), decode([f.buffer for f in frames])
    except ProtocolError as exc:
        log.warning("dropped a bad message on %s: %s", _endpoint(sock), exc)
        return None


def sender_of(frame: zmq.Frame) -> str:
    """The ``User-Id`` a received frame came with: its sender's z85 public key on a CURVE
    socket, "" on a plain one."""
    try:
        got = frame.get("User-Id")  # a string property: always a str
    except zmq.ZMQError:  # no ZAP handler set one
        return ""
    return got if isinstance(got, str) else ""


def recv_routed(
    sock: zmq.SyncSocket, timeout_ms: int | None = None
) -> tuple[bytes, Message] | None:
    """(sender identity, message) from a ROUTER socket; None on timeout or a bad message."""
    return _recv(sock, timeout_ms, routed=True)


def _recv(
    sock: zmq.SyncSocket, timeout_ms: int | None, routed: bool
) -> tuple[bytes, Message] | None:
    if timeout_ms is not None and not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    frames = sock.recv_multipart()
    identity = b""
    if routed:
        if len(frames) < 2:
            log.warning("dropped a routed message with %d frame(s)", len(frames))
            return None
        identity, frames = frames[0], frames[1:]
    try:
        return identity, decode(frames)
    except ProtocolError as exc:
        log.warning("dropped a bad message on %s: %s", _endpoint(sock), exc)
        return None


def _endpoint(sock: zmq.Socket[object]) -> str:
    try:
        return sock.getsockopt_string(zmq.LAST_ENDPOINT) or "a connected socket"
    except zmq.ZMQError:
        return "a socket"
