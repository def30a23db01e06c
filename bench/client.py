"""One streamed request against an OpenAI-compatible server, timed chunk by chunk.

``StreamParser`` is the whole timing logic, fed SSE lines with their arrival times, so tests can
drive it with synthetic timestamps; ``send`` only does the HTTP around it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any  # request bodies and usage are JSON: values of every type

import httpx

from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import RequestOutput

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class Target:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = False
    temperature: float | None = None

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(target: Target, req: BenchRequest, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model}
    if target.chat:
        if req.messages is not None:
            body["messages"] = list(req.messages)
        else:
            system = [{"role": "system", "content": req.system}] if req.system else []
            body["messages"] = [*system, {"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.max_tokens  # as vLLM's client sends it
    else:
        if req.messages is not None:
            raise ValueError("a messages request needs --endpoint /v1/chat/completions")
        body["prompt"] = f"{req.system} {req.prompt}" if req.system else req.prompt
        body["max_tokens"] = req.max_tokens
    if target.temperature is not None:
        body["temperature"] = target.temperature
    if target.ignore_eos:
        body["ignore_eos"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return {**body, **target.extra_body}


class StreamParser:
    """Turns ``data:`` lines and their arrival times into a ``RequestOutput``."""

    def __init__(self, start: float, chat: bool) -> None:
        self.start, self.chat = start, chat
        self.first: float | None = None
        self.first_content: float | None = None
        self.last = start
        self.itl: list[float] = []
        self.text: list[str] = []
        self.content_chunks = 0
        self.usage: dict[str, Any] | None = None
        self.error = ""

    def feed(self, line: str, now: float) -> bool:
        """Takes one SSE line; True once the stream says ``[DONE]``."""
        line = line.strip()
        if not line.startswith("data:"):
            return False  # blank lines, ": comments", event:/id: fields
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        body = json.loads(data)
        if not isinstance(body, dict):
            raise ValueError(f"a stream event that is not an object: {data[:100]}")
        if body.get("error"):
            err = body["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        if choices := body.get("choices"):
            if self.first is None:
                self.first = now
            else:
                self.itl.append(now - self.last)
            self.last = now
            choice = choices[0]
            piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if piece:
                if self.first_content is None:
                    self.first_content = now
                self.content_chunks += 1
                self.text.append(piece)
        if body.get("usage"):
            self.usage = body["usage"]
        return False

    def output(self, out: RequestOutput) -> RequestOutput:
        """Fills ``out``: a success only with a chunk carrying choices and no error event."""
        if self.error or self.first is None:
            out.error = self.error or "the stream carried no chunk with choices"
            return out
        out.success = True
        out.ttft = self.first - self.start
        out.latency = self.last - self.start
        if self.first_content is not None:
            out.ttft_content = self.first_content - self.start
        out.itl = self.itl
        out.generated_text = "".join(self.text)
        usage = self.usage or {}
        # without usage, one content chunk per token is the best a client can say
        out.output_tokens = usage.get("completion_tokens", self.content_chunks)
        out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        out.cached_tokens = cached if isinstance(cached, int) else None
        return out


async def send(
    client: httpx.AsyncClient, target: Target, req: BenchRequest, t0: float
) -> RequestOutput:
    """Streams one request; never raises for the server's or the network's failures."""
    out = RequestOutput(kind=req.kind, prompt_tokens=req.prompt_len, turn=req.turn)
    body = request_body(target, req)
    start = time.perf_counter()
    out.start_time = start - t0
    parser = StreamParser(start, target.chat)
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers()) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {_error_text(await r.aread())}"
                return out
            async for line in sse_lines(r):
                if parser.feed(line, time.perf_counter()):
                    break
    except (httpx.HTTPError, ValueError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    return parser.output(out)


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream, ended only by CRLF, LF or CR as the SSE spec says.

    ``aiter_lines`` splits where ``str.splitlines`` does, so a raw U+2028 or U+0085 inside a
    JSON string (which servers may send unescaped) would cut a chunk in two."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        # a trailing CR may be the first half of a CRLF: keep it for the next piece
        cut = len(pending) - 1 if pending.endswith("\r") else len(pending)
        *lines, rest = re.split(r"\r\n|\r|\n", pending[:cut])
        pending = rest + pending[cut:]
        for line in lines:
            yield line
    if pending:  # the last line, unterminated or ended by a lone CR
        yield pending[:-1] if pending.endswith("\r") else pending


def _error_text(raw: bytes) -> str:
    text = raw.decode(errors="replace")
    try:
        err = json.loads(text).get("error")
        return err.get("message", text) if isinstance(err, dict) else str(err or text)
    except (json.JSONDecodeError, AttributeError):
        return text[:300]


async def first_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first id ``/v1/models`` lists (vLLM's default ``--model``)."""
    target = Target(base_url, api_key=api_key)
    r = await client.get(base_url.rstrip("/") + "/v1/models", headers=target.headers())
    r.raise_for_status()
    models = r.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    model_id: str = models[0]["id"]
    return model_id


async def prompt_tokens(client: httpx.AsyncClient, target: Target, text: str) -> int | None:
    """The server's ``usage.prompt_tokens`` for ``text`` as a prompt (one output token)."""
    body = request_body(target, BenchRequest(text, 1, 0), stream=False)
    r = await client.post(target.url, json=body, headers=target.headers())
    if r.status_code != 200:
        raise ValueError(f"calibration request failed: HTTP {r.status_code}: {r.text[:300]}")
    return (r.json().get("usage") or {}).get("prompt_tokens")
