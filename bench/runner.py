"""One timed run: send each request at its scheduled time (at most ``max_concurrency`` in
flight, as vLLM: a request waiting for a slot starts its clock when it gets one), stop sending
after ``duration`` seconds, wait for what is in flight. The run's duration is from the first
send to the last response."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import httpx
import numpy as np

from pdserve.bench.arrivals import schedule
from pdserve.bench.client import Target, send
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import RequestOutput
from pdserve.bench.report import Progress


@dataclass(frozen=True)
class RunSpec:
    rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration: float | None = None  # seconds during which requests are sent
    seed: int = 0


def make_client(timeout_s: float) -> httpx.AsyncClient:
    """No connection cap: the arrival process, not the pool, decides what is in flight."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)


async def run_requests(
    client: httpx.AsyncClient,
    target: Target,
    requests: list[BenchRequest],
    spec: RunSpec,
    progress: Progress | None = None,
) -> tuple[list[RequestOutput], float]:
    """The outputs of the requests actually sent (in send order) and the run's duration."""
    timed = schedule(requests, spec.rate, spec.burstiness, np.random.default_rng(spec.seed))
    slots = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    t0 = time.perf_counter()

    def expired() -> bool:
        return spec.duration is not None and time.perf_counter() - t0 >= spec.duration

    async def one(req: BenchRequest) -> RequestOutput | None:
        if slots is None:
            out = await send(client, target, req, t0)
        else:
            async with slots:
                if expired():
                    return None
                out = await send(client, target, req, t0)
        if progress:
            progress.finished(out)
        return out

    if progress:
        progress.start(t0, len(timed))
    tasks = []
    for at, req in timed:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if expired():
            break
        tasks.append(asyncio.create_task(one(req)))
    if progress:
        progress.all_sent(len(tasks))
    outputs = [o for o in await asyncio.gather(*tasks) if o is not None]
    duration = time.perf_counter() - t0
    if progress:
        progress.close()
    return outputs, duration
