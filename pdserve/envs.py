"""Every environment variable pdserve reads, in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

API_KEY = "PDSERVE_API_KEY"


def pdserve_home() -> Path:
    """Root for pdserve's own files (the built-in models live under ``models/``)."""
    return Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))


def coordinator_address() -> str | None:
    """``PDSERVE_COORDINATOR``: the coordinator's inbox address, for workers and gateways."""
    return os.environ.get("PDSERVE_COORDINATOR") or None


def coordinator_bind() -> str:
    """``PDSERVE_COORDINATOR_BIND``: where the coordinator listens (port 0: any free one)."""
    return os.environ.get("PDSERVE_COORDINATOR_BIND", "tcp://127.0.0.1:0")


def api_key(env: Mapping[str, str] = os.environ) -> str | None:
    """``PDSERVE_API_KEY``: one more key the gateway accepts (blank: none)."""
    return env.get(API_KEY, "").strip() or None


KEYS = "PDSERVE_KEYS"
KEY_NAME = "PDSERVE_KEY_NAME"
INSECURE = "PDSERVE_INSECURE"


def keys_dir(env: Mapping[str, str] = os.environ) -> str | None:
    """``PDSERVE_KEYS``: the cluster's CURVE keys directory (``pdserve keygen``)."""
    return env.get(KEYS) or None


def key_name(env: Mapping[str, str] = os.environ) -> str | None:
    """``PDSERVE_KEY_NAME``: which identity in ``PDSERVE_KEYS`` this process is."""
    return env.get(KEY_NAME) or None


def insecure(env: Mapping[str, str] = os.environ) -> bool:
    """``PDSERVE_INSECURE=1``: no CURVE on internal sockets (anyone who reaches them owns them)."""
    return env.get(INSECURE, "") not in ("", "0")
