"""Embeddings a second through a served ``/v1/embeddings``, beside sentence-transformers on the
same directory in the same process (one side at a time, rounds alternating, medians).

    python -m pdserve.bench.experiments.embeddings_rate --url http://127.0.0.1:8000 \\
        --model all-minilm-l6-v2 --model-dir ~/.cache/pdserve/models/all-minilm-l6-v2

Short texts (8-14 words), ``--batch`` of them a request, ``--concurrency`` requests at once;
sentence-transformers encodes the same batches with its default batch size on ``--threads``
torch threads (the served worker's own share of the cores is what ``pdserve serve`` gave it).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import httpx

WORDS = [
    *("the", "a", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "river"),
    *("mountain", "city", "light", "night", "day", "rain", "sun", "music", "book", "paper"),
    *("table", "window", "garden", "coffee", "train", "station", "market", "street", "morning"),
]


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 14))) for _ in range(n)]


async def served_rate(url: str, model: str, batches: list[list[str]], concurrency: int) -> float:
    """Embeddings a second over ``batches``, ``concurrency`` requests in flight."""
    queue = list(batches)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def worker() -> None:
            while queue:
                batch = queue.pop()
                body: dict[str, Any] = {"model": model, "input": batch}
                r = await client.post("/v1/embeddings", json={**body, "encoding_format": "base64"})
                r.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return sum(len(b) for b in batches) / seconds


def local_rate(model: Any, batches: list[list[str]]) -> float:
    start = time.perf_counter()
    for batch in batches:
        model.encode(batch)
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True, help="the served name")
    p.add_argument("--model-dir", required=True, help="the same model, for sentence-transformers")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the local side")
    args = p.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    local = SentenceTransformer(args.model_dir, device="cpu")
    batches = [texts(args.batch, seed=i) for i in range(args.requests)]
    asyncio.run(served_rate(args.url, args.model, batches[:2], 1))  # warm both sides
    local_rate(local, batches[:2])
    served: dict[int, list[float]] = {c: [] for c in args.concurrency}
    mine: list[float] = []
    for _ in range(args.rounds):
        for c in args.concurrency:
            served[c].append(asyncio.run(served_rate(args.url, args.model, batches, c)))
        mine.append(local_rate(local, batches))
    st = statistics.median(mine)
    print(f"{args.requests} requests x {args.batch} short texts, {args.rounds} rounds, medians")
    print(f"sentence-transformers ({args.threads} thread(s)): {st:8.0f} embeddings/s")
    for c, rates in served.items():
        median = statistics.median(rates)
        rate = f"{median:8.0f} embeddings/s  ({median / st:.2f}x)"
        print(f"pdserve, {c} request(s) at once:       {rate}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
