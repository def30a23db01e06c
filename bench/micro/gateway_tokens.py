"""The gateway's cost per token, from the ZMQ frame to the SSE string, with no model behind it
(the socket write to the client is left out: it is the same for any token path).

One event loop holds a real ``ZmqBackend`` and, per stream, a ``JobRun`` read by
``stream_events`` (what the HTTP layer writes, less the socket write). A fake worker sends
pre-encoded ``TokenBatch`` frames, one per step with one one-token chunk per stream (as a decode
worker does). A step goes out once every stream has written the previous one's SSE event, so
the consumers keep up and nothing is coalesced. Reported per token: CPU time of the process
(its ZMQ I/O thread included) and wall time, median of the rounds after a warm-up one.

    .venv/bin/python bench/micro/gateway_tokens.py              # 32 streams x 64 tokens, 5 rounds
    .venv/bin/python bench/micro/gateway_tokens.py --streams 8 --tokens 256 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import zmq
import zmq.asyncio

from pdserve.engine.tokenizer import Tokenizer
from pdserve.gateway.jobs import Job
from pdserve.gateway.responses import stream_events
from pdserve.gateway.run import JobRun
from pdserve.gateway.zmq_backend import ZmqBackend
from pdserve.protocol import messages as m
from pdserve.protocol.codec import decode, encode

TEXT = (
    "The quick brown fox jumps over the lazy dog while the gateway turns every token into a "
    "server-sent event for a client that reads each one as soon as it is written. "
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="tokenizer directory (default: built-in tiny)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kind", default="chat", choices=["chat", "completion"])
    return p.parse_args()


async def one_round(
    tok: Tokenizer, args: argparse.Namespace, ids: list[int]
) -> tuple[float, float, float]:
    """One round: CPU and wall µs a token, and SSE events a stream."""
    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.PULL)  # the coordinator's inbox
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    backend = ZmqBackend(f"tcp://127.0.0.1:{port}", hello_interval_s=0.05, state_timeout_s=3600)
    await backend.start()
    worker = ctx.socket(zmq.PUSH)
    worker.setsockopt(zmq.SNDHWM, 0)
    worker.connect(backend.stream_address)
    try:
        runs = await accepted_streams(tok, args, backend, inbox, worker)
        frames = [step_frames(k, args.streams, args.tokens, ids) for k in range(args.tokens)]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        events = await stream_steps(runs, frames, worker)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await backend.close()
        ctx.destroy(linger=0)
    tokens = args.streams * args.tokens
    return cpu / tokens * 1e6, wall / tokens * 1e6, events / args.streams


async def accepted_streams(
    tok: Tokenizer,
    args: argparse.Namespace,
    backend: ZmqBackend,
    inbox: zmq.asyncio.Socket,
    worker: zmq.asyncio.Socket,
) -> list[JobRun]:
    """``args.streams`` started runs, each accepted by the fake coordinator."""
    while not isinstance(decode(await inbox.recv_multipart()), m.GatewayHello):
        pass  # the backend's connection to the coordinator is up
    await worker.send_multipart(encode(m.ClusterState(models=[], workers=[])))
    jobs = [
        Job(
            kind=args.kind,
            response_id=f"r{i}",
            model="tiny",
            requests=[
                m.Generate(
                    request_id=f"r{i}",
                    model="tiny",
                    prompt_token_ids=[1, 2, 3],
                    sampling=m.SamplingParams(),
                    n=1,
                    stream_address="",  # the backend fills in its own
                )
            ],
        )
        for i in range(args.streams)
    ]
    runs = [JobRun(backend, tok, j) for j in jobs]
    starts = [asyncio.create_task(run.start()) for run in runs]
    accepted = 0
    while accepted < len(runs):  # the coordinator accepts every request
        g = decode(await inbox.recv_multipart())
        if isinstance(g, m.Generate):
            await worker.send_multipart(encode(m.Accepted(request_id=g.request_id, choice=0)))
            accepted += 1
    await asyncio.gather(*starts)
    return runs


def step_frames(k: int, streams: int, tokens: int, ids: list[int]) -> list[bytes]:
    """A decode worker's step ``k``: token ``k`` of every stream, one ``TokenBatch``."""
    last = k == tokens - 1
    chunks = [
        m.TokenChunk(
            request_id=f"r{i}",
            choice=0,
            index=k,
            token_ids=[ids[k]],
            logprobs=None,
            finished=last,
            finish_reason=m.FinishReason.LENGTH if last else None,
            num_prompt_tokens=3,
            num_cached_tokens=0,
        )
        for i in range(streams)
    ]
    return encode(m.TokenBatch(chunks=chunks))


async def stream_steps(
    runs: list[JobRun], frames: list[list[bytes]], worker: zmq.asyncio.Socket
) -> int:
    """Send each step once every stream has written the previous one's SSE event; the SSE
    events written in all."""
    written = [0] * len(runs)
    steps_done = 0
    step_done = asyncio.Event()

    async def consume(i: int) -> None:
        async for _ in stream_events(runs[i]):
            written[i] += 1
            if min(written) > steps_done:
                step_done.set()

    consumers = [asyncio.create_task(consume(i)) for i in range(len(runs))]
    for frame in frames:
        step_done.clear()
        await worker.send_multipart(frame)
        await step_done.wait()
        steps_done += 1
    await asyncio.gather(*consumers)
    return sum(written)


def main() -> None:
    args = parse_args()
    if args.model is None:
        from pdserve.models.make_model import default_model_dir

        args.model = str(default_model_dir("tiny"))
    tok = Tokenizer.from_dir(args.model)
    ids = (tok.encode(TEXT * (1 + args.tokens // 20), add_special_tokens=False))[: args.tokens]
    rows = [asyncio.run(one_round(tok, args, ids)) for _ in range(args.rounds + 1)][1:]
    cpu = [r[0] for r in rows]
    wall = [r[1] for r in rows]
    print(
        f"streams {args.streams}  tokens {args.tokens}  kind {args.kind}  rounds {args.rounds}  "
        f"SSE events per stream {rows[0][2]:.0f} (incl. [DONE])"
    )
    for name, values in (("CPU ", cpu), ("wall", wall)):
        rounds = [round(x, 2) for x in values]
        print(f"{name} us/token: median {statistics.median(values):6.2f}  rounds {rounds}")


if __name__ == "__main__":
    main()
