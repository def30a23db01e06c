"""``pdserve serve``'s API flags (vLLM's names) and what they become on the gateway's command line.

    --served-model-name A B C   workers register A; the gateway takes B and C as aliases of A
    --api-key K, --api-key-file F
                                the gateway reads every key from a file in the launch's private
                                run directory (never on a command line ``ps`` shows)
    --chat-template T           read and checked here once, handed over as a file
    --allowed-origins ...       CORS, passed through
    --tool-call-parser P        passed through (--enable-auto-tool-choice: accepted, a no-op)
    --tenants F, --usage-db F   passed through as absolute paths (SIGHUP to serve reloads the
                                tenants file: it is forwarded to the gateway)
    --rate-limit-store U, --rate-limit-gateways N, --rate-limit-store-password-file F
                                passed through (the file as an absolute path)

Each is checked here, before any process starts: a gateway that cannot start would only be
restarted until serve gives up.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from pdserve.gateway.chat_template import load_chat_template
from pdserve.gateway.config import API_KEY_ENV, GatewayConfig, list_arg, load_api_keys
from pdserve.gateway.tenancy.args import MEMORY, add_tenancy_args, limiter_store
from pdserve.gateway.tenancy.tenants import TenantsError, load_tenants
from pdserve.gateway.tools.request import add_tool_args


def add_serve_api_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name in the API (default: its directory's name); more names are "
        "aliases, and responses report the first",
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"require 'Authorization: Bearer KEY' (repeatable; or ${API_KEY_ENV})",
    )
    g.add_argument("--api-key-file", help="a file of API keys, one per line")
    g.add_argument("--chat-template", help="a Jinja chat template: a file or the template itself")
    g.add_argument(
        "--allowed-origins",
        type=list_arg,
        default=[],
        help="CORS origins, a JSON list or comma-separated (default: no CORS)",
    )
    g.add_argument("--allowed-methods", type=list_arg, default=["*"], help="CORS methods")
    g.add_argument("--allowed-headers", type=list_arg, default=["*"], help="CORS headers")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    add_tool_args(g)
    add_tenancy_args(g)


def served_name(args: argparse.Namespace) -> str | None:
    """The name workers register (the first ``--served-model-name``)."""
    return args.served_model_name[0] if args.served_model_name else None


def gateway_api_flags(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The gateway's flags for ``args``; files it needs go in ``run_dir`` (private to this
    launch). Raises ``ValueError`` with a message for the user."""
    flags = []
    names = args.served_model_name or []
    aliases = tuple((alias, names[0]) for alias in names[1:])
    flags += [f"--model-alias={alias}={target}" for alias, target in aliases]
    keys = load_api_keys(args.api_key, args.api_key_file, env={})  # the env reaches it itself
    GatewayConfig(api_keys=keys, model_aliases=aliases)  # checked here: the gateway would fail
    if keys:
        key_file = run_dir / "api_keys"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(f"{key}\n" for key in keys))
        flags.append(f"--api-key-file={key_file}")
    if args.chat_template is not None:
        template = run_dir / "chat_template.jinja"
        template.write_text(load_chat_template(args.chat_template), encoding="utf-8")
        flags.append(f"--chat-template={template}")
    if args.allowed_origins:
        flags += [
            f"--allowed-origins={json.dumps(args.allowed_origins)}",
            f"--allowed-methods={json.dumps(args.allowed_methods)}",
            f"--allowed-headers={json.dumps(args.allowed_headers)}",
        ]
        flags += ["--allow-credentials"] if args.allow_credentials else []
    if args.tool_call_parser != "auto":
        flags.append(f"--tool-call-parser={args.tool_call_parser}")
    return flags + tenancy_flags(args)


def tenancy_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's tenancy flags, checked here (``ValueError``)."""
    flags = []
    if args.tenants:
        try:
            load_tenants(args.tenants)
        except TenantsError as e:
            raise ValueError(str(e)) from e
        flags.append(f"--tenants={os.path.abspath(args.tenants)}")
    password_file = args.rate_limit_store_password_file
    limiter_store(args.rate_limit_store, args.rate_limit_gateways, password_file)  # checks
    if args.rate_limit_store != MEMORY:
        flags.append(f"--rate-limit-store={args.rate_limit_store}")
    if args.rate_limit_gateways != 1:
        flags.append(f"--rate-limit-gateways={args.rate_limit_gateways}")
    if password_file:
        flags.append(f"--rate-limit-store-password-file={os.path.abspath(password_file)}")
    if args.usage_db:
        flags.append(f"--usage-db={os.path.abspath(args.usage_db)}")
    return flags
