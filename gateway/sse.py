"""Server-sent events as the gateway writes them: one JSON object a ``data:`` line, compact,
never broken by a line separator inside a string."""

from __future__ import annotations

import json
from typing import Any

# Characters many line splitters (``str.splitlines``, httpx's ``aiter_lines``) break on, that
# json.dumps leaves raw. They only occur inside JSON strings, where the escape means the same.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # json.dumps makes one a call


def json_text(body: dict[str, Any]) -> str:
    """``body`` as compact JSON with no raw line separator."""
    data = _JSON.encode(body)
    if "\u2028" in data or "\u2029" in data or "\x85" in data:  # rare: translate costs 2 us
        data = data.translate(_LINE_BREAKS)
    return data


def sse(body: dict[str, Any]) -> str:
    return f"data: {json_text(body)}\n\n"
