"""``pdserve bench`` against a minimal OpenAI-compatible server written here (not our gateway):
the harness is a client of the API only."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.client import sse_lines
from pdserve.launch.cli import main

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "sk-stub"


def stub_app(seen: list[dict]) -> FastAPI:
    """Counts a prompt's words as its tokens; streams ``max_tokens`` chunks 2 ms apart; every
    fifth streamed request is refused with 503."""
    app = FastAPI()
    streamed = [0]

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stub-model"}, {"id": "other"}]}

    async def complete(request: Request, chat: bool):
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        body = await request.json()
        seen.append(body)
        if chat:
            text = " ".join(m["content"] for m in body["messages"])
            max_tokens = body["max_completion_tokens"]
        else:
            text, max_tokens = body["prompt"], body["max_tokens"]
        usage = {"prompt_tokens": len(text.split()), "completion_tokens": max_tokens}
        if not body.get("stream"):
            return {"choices": [{"index": 0, "text": "x"}], "usage": usage}
        streamed[0] += 1
        if streamed[0] % 5 == 0:
            return JSONResponse({"error": {"message": "stub overloaded"}}, status_code=503)

        def choice(i: int) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": f"w{i} "}}
            return {"index": 0, "text": f"w{i}\u2028 "}  # raw below, as pydantic writes it

        def sse(event: dict) -> str:
            return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"

        async def events():
            if chat:  # a role-only first chunk: TTFT before the first content
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(max_tokens):
                await asyncio.sleep(0.002)
                yield sse({"choices": [choice(i)]})
            if body.get("stream_options", {}).get("include_usage"):
                yield sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, chat=True)

    return app


@pytest.fixture
def stub():
    seen: list[dict] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(stub_app(seen), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    server.should_exit = True
    thread.join(10)
    sock.close()


def bench(url: str, *flags: str) -> list[str]:
    return ["bench", f"--base-url={url}", f"--api-key={API_KEY}", "--no-progress", *flags]


def test_completions_against_stub(stub, tmp_path) -> None:
    url, seen = stub
    out = tmp_path / "r.json"
    argv = bench(
        url,
        "--num-prompts=10",
        "--random-input-len=40",
        "--random-output-len=6",
        "--request-rate=200",
        "--ignore-eos",
        '--extra-body={"top_k": 5}',
        "--slo",
        "tpot:1000",
        f"--save-result={out}",
        "--save-detailed",
        f"--plot={tmp_path / 'plots'}",
    )
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["model_id"]) == (8, 2, "stub-model")
    assert r["error_summary"] == {"HTTP 503: stub overloaded": 2}
    # calibration measured 1 token per word, so each prompt is exactly 40 tokens
    assert r["total_input_tokens"] == 8 * 40
    assert sorted(r["output_lens"]) == [0, 0] + [6] * 8
    assert (r["good_requests"], r["slo_attainment"]) == (8, 0.8)
    assert r["request_goodput"] == r["request_throughput"]
    assert all(len(itl) == 5 for itl, e in zip(r["itls"], r["errors"], strict=True) if not e)
    streamed = [b for b in seen if b.get("stream")]
    assert len(streamed) == 10 and len(seen) == 12  # two calibration probes
    assert {(b["model"], b["top_k"], b["ignore_eos"], b["max_tokens"]) for b in streamed} == {
        ("stub-model", 5, True, 6)
    }
    assert all(b["stream_options"] == {"include_usage": True} for b in streamed)
    png = (tmp_path / "plots" / "latency_cdf.png").read_bytes()
    assert png.startswith(b"\x89PNG")


def test_chat_sweep_against_stub(stub, tmp_path) -> None:
    url, _ = stub
    out = tmp_path / "sweep.json"
    argv = bench(
        url,
        "--endpoint=/v1/chat/completions",
        "--model=other",
        "--dataset=shared-prefix",
        "--shared-prefix-len=30",
        "--shared-prefix-groups=2",
        "--num-prompts=5",
        "--random-input-len=10",
        "--random-output-len=4",
        "--request-rate=100,inf",
        "--slo",
        "ttft:0.001",
        f"--save-result={out}",
        f"--plot={tmp_path}",
    )
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("pdserve ")
    rows = saved["rows"]
    assert [row["request_rate"] for row in rows] == [100.0, "inf"]
    assert rows[0]["rate"] == 100.0 and rows[1]["rate"] == rows[1]["request_throughput"]
    assert [(row["completed"], row["failed"]) for row in rows] == [(4, 1), (4, 1)]
    assert [row["total_input_tokens"] for row in rows] == [160, 160]  # 30 + 10 per request
    assert [row["slo_attainment"] for row in rows] == [0.0, 0.0]  # nobody makes 1 µs TTFT
    assert saved["max_rate_meeting_slo"] is None
    for row in rows:  # the role-only chunk comes first, content after
        assert row["mean_ttft_content_ms"] > row["mean_ttft_ms"] > 0
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


def test_bad_target_and_flags(stub) -> None:
    url, _ = stub
    assert main(bench(url, "--api-key=wrong", "--num-prompts=1")) == 2  # 401 on calibration
    assert main(bench(url, "--slo", "latency:3")) == 2
    assert main(bench(url, "--dataset=jsonl")) == 2


def test_harness_imports_no_serving_code(stub, tmp_path) -> None:
    url, _ = stub
    argv = bench(url, "--num-prompts=3", "--random-output-len=2", f"--plot={tmp_path}")
    code = (
        "import sys\nfrom pdserve.launch.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        "bad = ('engine', 'gateway', 'coordinator', 'prefill', 'decode', 'kvtransfer',"
        " 'protocol', 'worker')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.split('.')[:2] in [['pdserve', b] for b in bad])\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_sse_lines_end_only_at_cr_and_lf() -> None:
    # U+2028 split across two reads, CRLF split across two reads, a lone CR, U+0085
    pieces = [b"data: a\xe2\x80", b"\xa8b\r", b"\ndata: c\xc2\x85d\rdata: e\n\n", b"data: [DONE]"]

    async def lines() -> list[str]:
        async def body():
            for piece in pieces:
                yield piece

        response = httpx.Response(200, content=body())
        return [line async for line in sse_lines(response)]

    assert asyncio.run(lines()) == [
        "data: a\u2028b",
        "data: c\x85d",
        "data: e",
        "",
        "data: [DONE]",
    ]
