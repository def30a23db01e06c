"""KV by need (issue 36): at a fixed KV memory, requests that ask ``max_tokens`` 1,024 and stop
after ~64 tokens. Per arm: requests served and refused, the most streams the decode workers ran
at once, output tokens/s at ``--streams`` concurrent streams, preemptions. Arms alternate per
round; medians over rounds.

    python -m bench.experiments.kv_by_need --rounds 3 [--before-tree DIR]

``--before-tree`` (and ``--after-tree``): a tree whose ``pdserve/`` mirrors the installed
names of another checkout (``make typecheck`` builds one for this checkout under
``.venv/typecheck``; do the same for a ``git worktree`` of another commit): that arm's processes
import it first (``PYTHONPATH``).
A request stops after ``--stop-after`` tokens at the first of a few common tokens (``min_tokens``
holds stop tokens back until then; sampled, seeded per request: greedy loops on this model
without ever reaching one), so its length does not depend on the model's EOS.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from pdserve.bench.experiments.cluster import ServeProcess

RUNNING = re.compile(r'^pdserve_requests_running\{role="(?:decode|both)"[^}]*\} (\S+)$', re.M)
PREEMPTED = re.compile(r"^pdserve_worker_preemptions_total\{[^}]*\} (\S+)$", re.M)
STOPS = [".", ",", " the", " a", "\n", " and"]
WORDS = [
    *("river", "stone", "light", "winter", "market", "song"),
    *("garden", "letter", "city", "morning", "story", "window"),
]


@contextmanager
def python_path(tree: str | None) -> Iterator[None]:
    old = os.environ.get("PYTHONPATH")
    if tree:
        os.environ["PYTHONPATH"] = tree
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


async def crowd(
    url: str, model: str, args: argparse.Namespace, stop_ids: list[int]
) -> dict[str, float]:
    rng = random.Random(0)
    prompts = [
        " ".join(
            f"The {rng.choice(WORDS)} was near the {rng.choice(WORDS)}."
            for _ in range(args.prompt_sentences)
        )
        + " Tell the story of it."
        for _ in range(64)
    ]
    body = {
        "model": model,
        "max_tokens": args.max_tokens,
        "min_tokens": args.stop_after,
        "stop_token_ids": stop_ids,
        "temperature": 0.8,  # greedy loops on this model, never reaching a stop token
    }
    tokens, refused = 0, 0
    async with httpx.AsyncClient(timeout=600) as client:
        queue = list(range(args.requests))

        async def worker() -> None:
            nonlocal tokens, refused
            while queue:
                i = queue.pop()
                r = await client.post(
                    f"{url}/v1/completions",
                    json={**body, "prompt": prompts[i % len(prompts)], "seed": i},
                )
                if r.status_code == 200:
                    tokens += r.json()["usage"]["completion_tokens"]
                else:
                    refused += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.streams)))
        seconds = time.perf_counter() - start
    served = args.requests - refused
    return {
        "tokens_per_s": tokens / seconds,
        "refused": refused,
        "tokens": tokens,
        "mean_output": tokens / max(served, 1),
    }


def one_run(
    arm: str, tree: str | None, args: argparse.Namespace, stop_ids: list[int]
) -> dict[str, float]:
    flags = [f"--kv-cache-memory={args.kv_cache_memory}", *args.flags.split()]
    with python_path(tree):
        cluster = ServeProcess(args.model, flags)
    peak = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                text = httpx.get(f"{cluster.url}/metrics", timeout=5).text
                peak[0] = max(peak[0], sum(float(v) for v in RUNNING.findall(text)))
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        model = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]["id"]
        result = asyncio.run(crowd(cluster.url, model, args, stop_ids))
        text = httpx.get(f"{cluster.url}/metrics", timeout=5).text
        result["preemptions"] = sum(float(v) for v in PREEMPTED.findall(text))
    finally:
        done.set()
        watcher.join()
        cluster.stop()
    result["peak_running"] = peak[0]
    print(arm, result, flush=True)
    return result


def main() -> None:
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.models.pull import pull_model
    from pdserve.models.store import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the real default model")
    p.add_argument("--kv-cache-memory", default="256M")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--stop-after", type=int, default=64)
    p.add_argument("--prompt-sentences", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--flags", default="--mode=disagg", help="more pdserve serve flags")
    p.add_argument("--before-tree", default=None)
    p.add_argument("--after-tree", default=None, help="as --before-tree (default: this one)")
    args = p.parse_args()
    args.model = args.model or str(pull_model(DEFAULT_MODEL))
    tok = Tokenizer.from_dir(Path(args.model))
    stop_ids = sorted({tok.encode(s, add_special_tokens=False)[-1] for s in STOPS})
    arms = [("after", args.after_tree)]
    arms += [("before", args.before_tree)] if args.before_tree else []
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm, _ in arms}
    for r in range(args.rounds):
        for arm, tree in arms if r % 2 == 0 else reversed(arms):
            results[arm].append(one_run(arm, tree, args, stop_ids))
    print(
        f"\n{args.streams} streams, {args.requests} requests, KV {args.kv_cache_memory}, "
        f"max_tokens {args.max_tokens}, stop after ~{args.stop_after}: medians of {args.rounds}"
    )
    print("| arm | output tokens/s | refused | mean output | peak streams running | preemptions |")
    print("|---|---|---|---|---|---|")
    for arm, runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        print(
            f"| {arm} | {med['tokens_per_s']:.1f} | {med['refused']:.0f} | "
            f"{med['mean_output']:.0f} | {med['peak_running']:.0f} | {med['preemptions']:.0f} |"
        )


if __name__ == "__main__":
    main()
