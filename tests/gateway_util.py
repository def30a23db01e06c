"""Gateway test helpers: a scripted fake backend (a test double for the ZMQ client), a fake
cluster (a test double for the coordinator and its workers, over real ZMQ sockets), a real
uvicorn server on a free loopback port, a strict parser of the Prometheus text format, and waits
on events (with deadlines that only catch hangs)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import math
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
import zmq
from fastapi import FastAPI

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.admission import AdmissionState
from pdserve.gateway.app import create_app
from pdserve.gateway.backend import Backend, BackendError
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.token_streams import ChoiceOrder
from pdserve.protocol import messages as m
from pdserve.protocol.codec import encode
from pdserve.runtime.sockets import bound_address, make_socket, recv_msg


def fake_logprobs(token_id: int, index: int, k: int, vocab_size: int) -> m.TokenLogprob:
    """Deterministic logprobs: -(index + 1) / 10 for the sampled token, alternatives below it."""
    lp = -(index + 1) / 10
    top = [((token_id + j) % vocab_size, lp - j) for j in range(k)]
    return m.TokenLogprob(token_id=token_id, logprob=lp, rank=1, top=top)


def generate(
    request_id: str, prompt_token_ids: list[int], sampling: m.SamplingParams, n: int = 1
) -> m.Generate:
    """A backend request for model "tiny", as the app makes it (no stream address: the backend
    fills in its own)."""
    return m.Generate(
        request_id=request_id,
        model="tiny",
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        n=n,
        stream_address="",
    )


def served_model(name: str, max_model_len: int, root: str | None = None) -> m.ServedModel:
    """A model ready to serve, as the coordinator's ``ClusterState`` lists it (root
    ``/models/<name>`` unless given)."""
    return m.ServedModel(
        name=name, root=root or f"/models/{name}", max_model_len=max_model_len, ready=True
    )


@dataclass
class Script:
    """What the fake generates: token ids per choice (choice c plays ``choices[c % len]``)."""

    choices: list[list[int]]
    finish: str = "stop"  # finish reason when a choice's ids run out (its last id is the eos)
    prefill_last: bool = False  # token 0 of every choice arrives after all decode tokens
    decode_batch: int = 1  # tokens per decode chunk
    repeat: bool = False  # every decode chunk comes twice, the second after the next one
    drop: int | None = None  # the chunk at this token index never comes (a gap never filled)
    interval_s: float = 0.0  # between two chunks (0: the loop still runs in between)
    cached_tokens: int = 0
    fail_after: int | None = None  # raise BackendError instead of the k-th chunk
    hang_after: int | None = None  # send k chunks, then nothing until aborted
    reject_status: int | None = None  # refuse the submit with this status
    crash_on_submit: bool = False  # a bug in the backend client, not a refusal
    hang_on_submit: bool = False  # submit never returns (it can be cancelled)
    vocab_size: int = 2048


def plan(request: m.Generate, script: Script) -> list[m.TokenChunk]:
    """The chunks prefill + decode workers would send, in the order they arrive."""
    max_tokens = request.sampling.max_tokens
    k, kp = request.sampling.logprobs, request.sampling.prompt_logprobs
    prompt = request.prompt_token_ids
    scored = None  # the prompt's scores, with token 0 (as the worker that ran it sends them)
    if kp is not None:
        scored = [fake_logprobs(t, i, kp, script.vocab_size) for i, t in enumerate(prompt[1:])]
    prefill, decode = [], []
    for c in range(request.n):
        ids = script.choices[c % len(script.choices)]
        finish = "length" if len(ids) > max_tokens else script.finish
        ids = ids[:max_tokens]
        spans = [(0, min(1, len(ids)))] + [  # max_tokens 0: one chunk, no token, finished
            (i, min(i + script.decode_batch, len(ids)))
            for i in range(1, len(ids), script.decode_batch)
        ]
        chunks = [
            m.TokenChunk(
                request_id=request.request_id,
                choice=c,
                index=start,
                token_ids=ids[start:end],
                logprobs=None
                if k is None
                else [
                    fake_logprobs(t, start + j, k, script.vocab_size)
                    for j, t in enumerate(ids[start:end])
                ],
                finished=end == len(ids),
                finish_reason=finish if end == len(ids) else None,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_cached_tokens=script.cached_tokens if start == 0 else 0,
                prompt_logprobs=scored if start == 0 else None,
            )
            for start, end in spans
            if start != script.drop
        ]
        if chunks and chunks[0].index == 0:
            prefill.append(chunks.pop(0))
        if script.repeat:  # each one again after the next: a resumed worker, a late chunk
            chunks = [x for i in range(len(chunks)) for x in (chunks[i], *chunks[i - 1 : i])]
            chunks += chunks[-1:]
        decode.append(chunks)
    interleaved = [e for step in _round_robin(decode) for e in step]
    return interleaved + prefill if script.prefill_last else prefill + interleaved


def _round_robin(lists: list[list[m.TokenChunk]]) -> list[list[m.TokenChunk]]:
    longest = max((len(x) for x in lists), default=0)
    return [[x[i] for x in lists if i < len(x)] for i in range(longest)]


@dataclass
class FakeBackend(Backend):
    """Test double for the ZMQ client: replays ``script`` for every submitted request."""

    model_infos: list[m.ServedModel]
    script: Script = field(default_factory=lambda: Script([[1]]))
    healthy: bool = True
    stats: list[m.WorkerStatus] = field(default_factory=list)
    submitted: list[m.Generate] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    _abort_events: dict[str, asyncio.Event] = field(default_factory=dict)

    def reset(self, script: Script) -> None:
        self.script = script
        self.submitted.clear()
        self.aborted.clear()

    async def submit(self, request: m.Generate) -> AsyncIterator[m.TokenChunk]:
        script = self.script
        if script.crash_on_submit:
            raise RuntimeError("client bug")
        if script.reject_status is not None:
            raise BackendError("no capacity", script.reject_status)
        self.submitted.append(request)
        if script.hang_on_submit:
            await asyncio.Event().wait()
        self._abort_events[request.request_id] = asyncio.Event()
        return self._events(request, script)

    async def _events(self, request: m.Generate, script: Script) -> AsyncIterator[m.TokenChunk]:
        """The plan's chunks as they arrive, through the reorder every backend uses."""
        orders = [ChoiceOrder() for _ in range(request.n)]
        for i, chunk in enumerate(plan(request, script)):
            await asyncio.sleep(script.interval_s)
            if i == script.fail_after:
                raise BackendError("decode worker died", 500)
            if i == script.hang_after:
                await self._abort_events[request.request_id].wait()
                return
            for ready in orders[chunk.choice].push(chunk):
                yield ready

    async def abort(self, request_id: str) -> None:
        await asyncio.sleep(0)  # a real abort sends a message: it suspends, and can be cancelled
        self.aborted.append(request_id)
        if request_id in self._abort_events:
            self._abort_events[request_id].set()

    def models(self) -> list[m.ServedModel]:
        return self.model_infos

    def health(self) -> bool:
        return self.healthy

    def worker_stats(self) -> list[m.WorkerStatus]:
        return self.stats


# What FakeCluster sends for one Generate: (role, message), ("sleep", seconds) to delay the rest,
# or ("wait", threading.Event) to hold the rest until the test sets the event.
ClusterScript = Callable[[m.Generate], list[tuple[str, Any]]]


class FakeCluster:
    """Test double for the coordinator + one prefill and one decode worker: binds the coordinator
    inbox, answers each ``GatewayHello`` with ``state``, and answers each ``Generate`` with
    ``respond``'s messages, each from the socket of the role that would send it. Delays are
    scheduled, so hellos are still answered while a slow stream plays."""

    def __init__(self, respond: ClusterScript) -> None:
        self.respond = respond
        self.state: m.ClusterState | None = None  # None: leave hellos unanswered
        self.hellos: list[m.GatewayHello] = []
        self.generates: list[m.Generate] = []
        self.aborts: list[m.Abort] = []
        self._ctx = zmq.Context()
        self._inbox = make_socket(self._ctx, zmq.PULL, "tcp://127.0.0.1:0", bind=True)
        self.address = bound_address(self._inbox)
        self._senders: dict[tuple[str, str], zmq.Socket] = {}  # (role, address) -> PUSH
        self._due: list[tuple[float, int, str, str, m.Message]] = []  # heap: (when, seq, ...)
        self._held: list[tuple[threading.Event, str, list[tuple[str, Any]]]] = []  # on "wait"
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            for held in [h for h in self._held if h[0].is_set()]:
                self._held.remove(held)
                self._schedule(held[1], held[2])
            while self._due and self._due[0][0] <= time.monotonic():
                _, _, role, address, item = heapq.heappop(self._due)
                self._send(role, address, item)
            msg = recv_msg(self._inbox, timeout_ms=5)
            if isinstance(msg, m.GatewayHello):
                self.hellos.append(msg)
                if self.state is not None:
                    self._send("coordinator", msg.stream_address, self.state)
            elif isinstance(msg, m.Generate):
                self.generates.append(msg)
                self._schedule(msg.stream_address, self.respond(msg))
            elif isinstance(msg, m.Abort):
                self.aborts.append(msg)

    def _schedule(self, address: str, script: list[tuple[str, Any]]) -> None:
        at = time.monotonic()
        for i, (role, item) in enumerate(script):
            if role == "sleep":
                at += item
            elif role == "wait":
                self._held.append((item, address, script[i + 1 :]))
                return
            else:
                heapq.heappush(self._due, (at, next(self._seq), role, address, item))

    def _send(self, role: str, address: str, msg: m.Message | m.TokenChunk) -> None:
        if isinstance(msg, m.TokenChunk):  # workers send a step's chunks as one batch
            msg = m.TokenBatch(chunks=[msg])
        sock = self._senders.get((role, address))
        if sock is None:
            sock = make_socket(self._ctx, zmq.PUSH, address, bind=False)
            self._senders[(role, address)] = sock
        sock.send_multipart(encode(msg))


def chunk(g: m.Generate, choice: int, index: int, ids: list[int], **kw: Any) -> m.TokenChunk:
    finish = kw.pop("finish_reason", None)
    return m.TokenChunk(
        request_id=g.request_id,
        choice=choice,
        index=index,
        token_ids=ids,
        logprobs=kw.pop("logprobs", None),
        finished=finish is not None,
        finish_reason=finish,
        num_prompt_tokens=len(g.prompt_token_ids),
        num_cached_tokens=0,
    )


@dataclass
class Served:
    url: str
    backend: FakeBackend
    metrics: GatewayMetrics
    admission: AdmissionState  # the app's in-flight count and drain flag


@contextlib.contextmanager
def serving_config(
    backend: FakeBackend, tokenizers: dict[str, Tokenizer], config: GatewayConfig
) -> Iterator[Served]:
    """``create_app`` with ``config`` on a live server (``running_server``)."""
    metrics = GatewayMetrics()
    app = create_app(backend, tokenizers, metrics=metrics, config=config)
    with running_server(app) as url:
        yield Served(url, backend, metrics, app.state.admission)


@contextlib.contextmanager
def running_server(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False). The deadline only
    catches a hang: a loaded machine may take long, and a test never measures speed with it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def wait_until(predicate: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    """``wait_for``, failing with ``what`` (the event waited on) when the deadline passes."""
    if not wait_for(predicate, timeout):
        raise AssertionError(f"not within {timeout:g} s: {what or predicate}")


@contextlib.contextmanager
def abandoned_post(url: str, path: str, body: dict[str, Any]) -> Iterator[socket.socket]:
    """POST ``body`` on a bare connection that hangs up when the block ends: a client that goes
    away at a moment the test chooses (once the request is in), not at a client timeout."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + payload)
        yield sock


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_SAMPLE = re.compile(
    rf"^(?P<name>{_NAME})(?:\{{(?P<labels>{_LABEL}(?:,{_LABEL})*)\}})? "
    r"(?P<value>[+-]?(?:Inf|NaN|[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?))$"
)
_LABEL_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}

Families = dict[str, tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]


def parse_prometheus(text: str) -> Families:
    """Families by name: (type, {(sample name, labels): value}); fails on any format breach."""
    assert text.endswith("\n") and not text.endswith("\n\n")
    families: Families = {}
    current: str | None = None
    helped: set[str] = set()
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert re.fullmatch(_NAME, name) and name not in helped, line
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name in helped and name not in families and kind in _SUFFIXES, line
            families[name] = (kind, {})
            current = name
        else:
            match = _SAMPLE.match(line)
            assert match and current is not None, line
            kind, samples = families[current]
            sample_name = match["name"]
            assert sample_name in {current + s for s in _SUFFIXES[kind]}, line
            labels = tuple(_LABEL_PAIR.findall(match["labels"] or ""))
            assert len({k for k, _ in labels}) == len(labels), line
            key = (sample_name, labels)
            assert key not in samples, f"duplicate series: {line}"
            value = match["value"]
            samples[key] = float(value.replace("Inf", "inf"))
    for name, (kind, samples) in families.items():
        if kind == "histogram":
            _check_histogram(name, samples)
    return families


def _check_histogram(name: str, samples: dict) -> None:
    series: dict[tuple, list[tuple[float, float]]] = {}
    for (sample, labels), value in samples.items():
        if sample == name + "_bucket":
            rest = tuple(p for p in labels if p[0] != "le")
            le = dict(labels)["le"]
            series.setdefault(rest, []).append((float(le.replace("Inf", "inf")), value))
    for rest, buckets in series.items():
        bounds = [b for b, _ in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf
        counts = [c for _, c in buckets]
        assert counts == sorted(counts), "buckets must be cumulative"
        assert samples[(name + "_count", rest)] == counts[-1]
        assert (name + "_sum", rest) in samples


# ---- shared by the gateway hardening tests ---------------------------------------------------

MODELS = [served_model("tiny", max_model_len=256)]
COMPLETION = {"model": "tiny", "prompt": "Hi"}
Serve = Callable[..., Served]


def error(message: str, code: str | None, type: str = "invalid_request_error") -> dict[str, Any]:
    """The OpenAI error body the gateway answers with."""
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


@contextlib.contextmanager
def serve_fake(tok: Tokenizer) -> Iterator[Serve]:
    """``start(config, script)``: the app over a FakeBackend on a live server, stopped on exit.
    The default script answers "ok"."""
    with contextlib.ExitStack() as stack:

        def start(config: GatewayConfig, script: Script | None = None) -> Served:
            eos = tok.eos_token_ids[0]
            backend = FakeBackend(MODELS, script or Script([[*tok.encode("ok", False), eos]]))
            return stack.enter_context(serving_config(backend, {"tiny": tok}, config))

        yield start
