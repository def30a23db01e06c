"""The gateway's limits and protections, built from the command line (``add_gateway_args``)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve import envs
from pdserve.gateway.chat_template import load_chat_template
from pdserve.gateway.tools.request import PARSER_CHOICES, add_tool_args

API_KEY_ENV = envs.API_KEY  # one more accepted API key
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_MAX_PENDING_REQUESTS = 1024
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_STREAM_IDLE_TIMEOUT_S = 180.0
DEFAULT_STREAM_SEND_TIMEOUT_S = 30.0
DEFAULT_MAX_STREAM_BACKLOG = 4096
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 2048


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's limits, protections and API options; checked when built (``ValueError``
    with a message for the user)."""

    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S  # 0: no limit
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS  # generation requests in flight
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # 0: stop at once on SIGTERM
    api_keys: tuple[str, ...] = ()  # empty: /v1/* is open
    # a stream with no event from the cluster this long ends with an error (0: no limit)
    stream_idle_timeout_s: float = DEFAULT_STREAM_IDLE_TIMEOUT_S
    # an SSE write the client does not take within this long cuts the stream off
    stream_send_timeout_s: float = DEFAULT_STREAM_SEND_TIMEOUT_S
    max_stream_backlog: int = DEFAULT_MAX_STREAM_BACKLOG  # events waiting for a slow reader
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a connection's request headers
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a generation request's whole body
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # beyond it, new requests get 503
    model_aliases: tuple[tuple[str, str], ...] = ()  # (alias, served model name)
    chat_template: str | None = None  # replaces every model's own template
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: off
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    tool_call_parser: str = "auto"  # --tool-call-parser (gateway.tools.request)

    def __post_init__(self) -> None:
        if not self.request_timeout_s >= 0:
            raise ValueError(f"request timeout must be >= 0 s, got {self.request_timeout_s}")
        if self.max_pending_requests < 1:
            raise ValueError(f"max pending requests must be >= 1, got {self.max_pending_requests}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max body bytes must be >= 1, got {self.max_body_bytes}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain timeout must be >= 0 s, got {self.drain_timeout_s}")
        if not self.stream_idle_timeout_s >= 0:
            raise ValueError(
                f"stream idle timeout must be >= 0 s, got {self.stream_idle_timeout_s}"
            )
        for name in ("stream_send_timeout_s", "header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name.replace('_', ' ')[:-2]} must be > 0 s, got {value}")
        for name in ("max_stream_backlog", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}"
                )
        for key in self.api_keys:
            if not key or any(c.isspace() for c in key) or not key.isprintable():
                raise ValueError("an API key must be non-empty printable text without spaces")
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(
                f"tool call parser must be one of {', '.join(PARSER_CHOICES)}, "
                f"got {self.tool_call_parser!r}"
            )
        aliases = [alias for alias, _ in self.model_aliases]
        for alias, target in self.model_aliases:
            if not alias or not target or alias == target or aliases.count(alias) > 1:
                raise ValueError(
                    f"a model alias must name a different model once, got {alias!r} -> {target!r}"
                )

    @property
    def timeout_s(self) -> float | None:
        return self.request_timeout_s or None

    @property
    def idle_timeout_s(self) -> float | None:
        return self.stream_idle_timeout_s or None


def load_api_keys(
    keys: Sequence[str], key_file: str | None, env: Mapping[str, str] = os.environ
) -> tuple[str, ...]:
    """``--api-key`` values, then the non-blank lines of ``key_file``, then ``$PDSERVE_API_KEY``,
    without duplicates. A key file that names no key is an error, not an open gateway."""
    found = [k.strip() for k in keys]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the API key file {key_file}: {e}") from e
        from_file = [line.strip() for line in lines if line.strip()]
        if not from_file:
            raise ValueError(f"the API key file {key_file} has no key")
        found += from_file
    from_env = envs.api_key(env)
    if from_env is not None:
        found.append(from_env)
    return tuple(dict.fromkeys(found))


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Every flag ``config_from_args`` reads."""
    _add_request_args(parser)
    _add_key_args(parser)
    _add_stream_args(parser)
    _add_connection_args(parser)
    add_api_args(parser)
    add_tool_args(parser)


def _add_request_args(parser: argparse.ArgumentParser) -> None:
    """A generation request's bounds, and the drain's."""
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metavar="SECONDS",
        help="abort a generation running longer than this; 504, or an SSE error event (0: off)",
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=DEFAULT_MAX_PENDING_REQUESTS,
        help="generation requests in flight at this gateway; beyond it, 429 with Retry-After",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body accepted (413 beyond it)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM, refuse new requests and let running ones finish for this long",
    )


def _add_key_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; visible in ps: "
        f"prefer --api-key-file or ${API_KEY_ENV})",
    )
    parser.add_argument("--api-key-file", help="a file of API keys, one per line")


def _add_stream_args(parser: argparse.ArgumentParser) -> None:
    """A stream's bounds: silence from the cluster, a client that does not read."""
    parser.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=DEFAULT_STREAM_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="end a generation that got nothing from the cluster for this long (0: off)",
    )
    parser.add_argument(
        "--stream-send-timeout",
        type=float,
        default=DEFAULT_STREAM_SEND_TIMEOUT_S,
        metavar="SECONDS",
        help="cut off a streaming client that takes no data for this long",
    )
    parser.add_argument(
        "--max-stream-backlog",
        type=int,
        default=DEFAULT_MAX_STREAM_BACKLOG,
        help="token events held for a slow streaming client before it is cut off",
    )


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    """What one HTTP connection may hold."""
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="close a connection whose request headers take longer than this",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help="answer 408 to a request whose body takes longer than this",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open HTTP connections; beyond it, requests get 503",
    )


def list_arg(value: str) -> list[str]:
    """vLLM's JSON list (``'["https://a.example"]'``), or comma-separated values."""
    if value.lstrip().startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value}")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


def _alias_arg(value: str) -> tuple[str, str]:
    alias, sep, target = value.partition("=")
    if not sep or not alias or not target:
        raise argparse.ArgumentTypeError(f"expected ALIAS=MODEL, got {value!r}")
    return alias, target


def add_api_args(parser: argparse.ArgumentParser) -> None:
    """Model names, chat template and CORS (vLLM's flags)."""
    parser.add_argument(
        "--model-alias",
        type=_alias_arg,
        action="append",
        default=[],
        metavar="ALIAS=MODEL",
        help="one more name clients may use for a served model (repeatable); "
        "responses report the model's own name",
    )
    parser.add_argument(
        "--chat-template",
        help="a Jinja chat template (a file, or the template itself) used instead of every "
        "model's own",
    )
    parser.add_argument(
        "--allowed-origins",
        type=list_arg,
        default=[],
        help="CORS origins, a JSON list or comma-separated, e.g. '[\"*\"]' (default: no CORS)",
    )
    parser.add_argument("--allowed-methods", type=list_arg, default=["*"], help="CORS methods")
    parser.add_argument("--allowed-headers", type=list_arg, default=["*"], help="CORS headers")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")


def config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] = os.environ
) -> GatewayConfig:
    """Raises ``ValueError`` with a message for the user."""
    return GatewayConfig(
        request_timeout_s=args.request_timeout,
        max_pending_requests=args.max_pending_requests,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
        api_keys=load_api_keys(args.api_key, args.api_key_file, env),
        stream_idle_timeout_s=args.stream_idle_timeout,
        stream_send_timeout_s=args.stream_send_timeout,
        max_stream_backlog=args.max_stream_backlog,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        model_aliases=tuple(args.model_alias),
        chat_template=None
        if args.chat_template is None
        else load_chat_template(args.chat_template),
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        tool_call_parser=args.tool_call_parser,
    )
