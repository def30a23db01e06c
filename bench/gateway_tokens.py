"""The gateway's cost per token, from the ZMQ frame to the SSE string, with no model behind it
(the socket write to the client is left out: it is the same for any token path).

One event loop holds a real ``ZmqBackend`` and, per stream, a ``Generation`` read by
``stream_events`` (what the HTTP layer writes, less the socket write). A fake worker sends
pre-encoded ``TokenBatch`` frames, one per step with one one-token chunk per stream (as a decode
worker does). A step goes out once every stream has written the previous one's SSE event, so
the consumers keep up and nothing is coalesced. Reported per token: CPU time of the process
(its ZMQ I/O thread included) and wall time, median of the rounds after a warm-up one.

    .venv/bin/python bench/gateway_tokens.py                    # 32 streams x 64 tokens, 5 rounds
    .venv/bin/python bench/gateway_tokens.py --streams 8 --tokens 256 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]

from pdserve.engine.tokenizer import Tokenizer  # noqa: E402
from pdserve.gateway.backend import GenerateRequest  # noqa: E402
from pdserve.gateway.generation import Generation  # noqa: E402
from pdserve.gateway.jobs import Job  # noqa: E402
from pdserve.gateway.stream import stream_events  # noqa: E402
from pdserve.gateway.zmq_backend import ZmqBackend  # noqa: E402
from pdserve.protocol import messages as m  # noqa: E402
from pdserve.protocol.codec import decode, encode  # noqa: E402

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


async def one_round(tok: Tokenizer, args: argparse.Namespace, ids: list[int]) -> tuple[float, ...]:
    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.PULL)  # the coordinator's inbox
    port = inbox.bind_to_random_port("tcp://127.0.0.1")
    backend = ZmqBackend(f"tcp://127.0.0.1:{port}", hello_interval_s=0.05, state_timeout_s=3600)
    await backend.start()
    worker = ctx.socket(zmq.PUSH)
    worker.setsockopt(zmq.SNDHWM, 0)
    worker.connect(backend.stream_address)
    try:
        while not isinstance(decode(await inbox.recv_multipart()), m.GatewayHello):
            pass  # the backend's connection to the coordinator is up
        await worker.send_multipart(encode(m.ClusterState([], [])))
        S, T = args.streams, args.tokens
        jobs = [
            Job(
                args.kind,
                f"r{i}",
                "tiny",
                [GenerateRequest(f"r{i}", "tiny", [1, 2, 3], m.SamplingParams(), 1)],
            )
            for i in range(S)
        ]
        gens = [Generation(backend, tok, j) for j in jobs]
        starts = [asyncio.create_task(g.start()) for g in gens]
        accepted = 0
        while accepted < S:  # the coordinator accepts every request
            g = decode(await inbox.recv_multipart())
            if isinstance(g, m.Generate):
                await worker.send_multipart(encode(m.Accepted(g.request_id, 0)))
                accepted += 1
        await asyncio.gather(*starts)

        def batch(k: int) -> list[bytes]:  # step k: token k of every stream
            end, reason = k == T - 1, "length" if k == T - 1 else None
            chunks = [
                m.TokenChunk(f"r{i}", 0, k, [ids[k]], None, end, reason, 3, 0) for i in range(S)
            ]
            return encode(m.TokenBatch(chunks))

        frames = [batch(k) for k in range(T)]
        written = [0] * S
        step_done = asyncio.Event()

        async def consume(i: int) -> None:
            async for _ in stream_events(gens[i]):
                written[i] += 1
                if min(written) > len(done_steps):
                    step_done.set()

        done_steps: list[int] = []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        consumers = [asyncio.create_task(consume(i)) for i in range(S)]
        for k in range(T):
            step_done.clear()
            await worker.send_multipart(frames[k])
            await step_done.wait()
            done_steps.append(k)
        await asyncio.gather(*consumers)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        events = sum(written)
    finally:
        await backend.close()
        ctx.destroy(linger=0)
    return cpu / (S * T) * 1e6, wall / (S * T) * 1e6, events / S


def main() -> None:
    args = parse_args()
    if args.model is None:
        from pdserve.engine.make_model import default_model_dir

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
