"""Does a tenant flooding the API hurt a steady one? The steady tenant's TTFT (streamed, to the
first content chunk) with nobody else, under a flood held to the flooder's limits and tier,
and under the same flood with no tenants file (nothing limited, one tier) for contrast.

    .venv/bin/python bench/experiments/tenant_flood.py [--model smollm2-135m-instruct]
        [--rounds 3] [--requests 20] [--out bench/results/tenant_flood.json]

Two clusters (``pdserve serve``, 1P1D, the default flags) run at once, the idle one costing next
to nothing: one with a tenants file (``steady``: standard tier, no limits; ``flooder``: batch
tier, ``--flood-rpm`` requests a minute, ``--flood-concurrent`` in flight, keys by
``pdserve keys add``'s code), one without. Each round runs three arms in turn:

    unloaded    tenants cluster: the steady tenant alone
    flood       tenants cluster: the steady tenant while the flooder floods
    open_flood  no-tenants cluster: the same two clients, nothing limited, one tier

The steady client sends ``--requests`` requests one after another (``--think`` s apart), each a
fresh random prompt of ``--steady-prompt`` tokens (no prefix-cache hit), ``max_tokens`` 8. The
flooder is ``--flood-clients`` threads sending fresh ``--flood-prompt``-token prompts with
``max_tokens`` ``--flood-max-tokens``, each at once after a 200 and ``--flood-pause`` s after a
429 (it ignores ``Retry-After``), from ``--warmup`` s before the steady client's first request
until its last ended. Per arm and round: the steady TTFT's p50 and p99, and the flood's attempts
and admissions a second; printed and saved as medians over rounds, with each round's figures.
The machine is shared and small: the flood's client threads run on it too.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any  # rounds and the report are JSON: values of every type

import httpx

from pdserve.bench.client import StreamParser
from pdserve.bench.experiments.cluster import ServeProcess
from pdserve.bench.metrics import RequestOutput

ARMS = ("unloaded", "flood", "open_flood")
VOCAB = (100, 40000)  # token ids drawn for prompts: within the model's vocabulary


def tenants_file(directory: Path, args: argparse.Namespace) -> tuple[Path, dict[str, str]]:
    """The tenants file, and a key for each tenant (added as ``pdserve keys add`` does)."""
    from pdserve.launch.keys import add_key

    path = directory / "tenants.toml"
    path.write_text(
        "[tenants.steady]\n"
        'tier = "standard"\n\n'
        "[tenants.flooder]\n"
        'tier = "batch"\n'
        f"requests_per_minute = {args.flood_rpm}\n"
        f"max_concurrent = {args.flood_concurrent}\n",
        encoding="utf-8",
    )
    return path, {t: add_key(path, t) for t in ("steady", "flooder")}


def lines(response: httpx.Response) -> Iterator[str]:
    """An event stream's lines, split at LF only (a JSON string may hold U+2028)."""
    pending = ""
    for text in response.iter_text():
        pending += text
        *done, pending = pending.split("\n")
        yield from done
    if pending:
        yield pending


def prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(tokens)]


def steady_ttfts(
    url: str, model: str, key: str, args: argparse.Namespace, seed: int
) -> list[float]:
    """The steady client's TTFTs (s, to the first content chunk), one request after another."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {key}"}
    out = []
    with httpx.Client(timeout=600) as client:
        for _ in range(args.requests):
            body = {
                "model": model,
                "prompt": prompt(rng, args.steady_prompt),
                "max_tokens": 8,
                "ignore_eos": True,
                "stream": True,
            }
            start = time.perf_counter()
            parser = StreamParser(start, chat=False)
            with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
                r.raise_for_status()
                for line in lines(r):
                    if parser.feed(line, time.perf_counter()):
                        break
            result = parser.output(RequestOutput(kind="steady", prompt_tokens=args.steady_prompt))
            if not result.success or result.ttft_content is None:
                raise RuntimeError(f"a steady request failed: {result.error}")
            out.append(result.ttft_content)
            time.sleep(args.think)
    return out


class Flood:
    """``--flood-clients`` threads sending as fast as the answers let them (module docstring);
    counts the answers by status and the tokens admitted requests generated."""

    def __init__(self, url: str, model: str, key: str, args: argparse.Namespace, seed: int):
        self.url, self.model, self.key, self.args = url, model, key, args
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.statuses: Counter[int] = Counter()
        self.completion_tokens = 0
        self.threads = [
            threading.Thread(target=self._client, args=(seed + i,), daemon=True)
            for i in range(args.flood_clients)
        ]

    def __enter__(self) -> Flood:
        self.started = time.perf_counter()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        self.elapsed = time.perf_counter() - self.started  # to the last answer

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        args = self.args
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                body = {
                    "model": self.model,
                    "prompt": prompt(rng, args.flood_prompt),
                    "max_tokens": args.flood_max_tokens,
                    "ignore_eos": True,
                }
                r = client.post(f"{self.url}/v1/completions", json=body, headers=headers)
                with self.lock:
                    self.statuses[r.status_code] += 1
                    if r.status_code == 200:
                        self.completion_tokens += r.json()["usage"]["completion_tokens"]
                if r.status_code != 200:
                    self.stop.wait(args.flood_pause)

    def figures(self) -> dict[str, Any]:
        attempts = sum(self.statuses.values())
        return {
            "attempts_per_s": attempts / self.elapsed,
            "admitted_per_s": self.statuses[200] / self.elapsed,
            "admitted_tokens_per_s": self.completion_tokens / self.elapsed,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
        }


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def run_arm(
    arm: str,
    serve: ServeProcess,
    model: str,
    keys: dict[str, str],
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    """One arm of one round: the steady client's TTFT p50/p99, and the flood's figures."""
    if arm == "unloaded":
        ttfts = steady_ttfts(serve.url, model, keys["steady"], args, seed)
        return {"p50_s": statistics.median(ttfts), "p99_s": p99(ttfts), "ttfts_s": ttfts}
    with Flood(serve.url, model, keys["flooder"], args, seed + 1000) as flood:
        time.sleep(args.warmup)
        ttfts = steady_ttfts(serve.url, model, keys["steady"], args, seed)
    figures = {"p50_s": statistics.median(ttfts), "p99_s": p99(ttfts), "ttfts_s": ttfts}
    return figures | {"flood": flood.figures()}


def run(args: argparse.Namespace, directory: Path) -> dict[str, list[dict[str, Any]]]:
    path, keys = tenants_file(directory, args)
    flags = ["--num-kv-blocks=1024", *args.serve_flag]
    clusters = {}
    try:
        tenants = [*flags, f"--tenants={path}"]
        clusters["tenants"] = ServeProcess(args.model, tenants, log=directory / "tenants.log")
        clusters["open"] = ServeProcess(args.model, flags, log=directory / "open.log")
        model = httpx.get(f"{clusters['open'].url}/v1/models", timeout=30).json()["data"][0]["id"]
        for serve in clusters.values():  # warm-up: one request each
            steady_ttfts(serve.url, model, keys["steady"], warm_args(args), seed=-1)
        rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        for i in range(args.rounds):
            for j, arm in enumerate(ARMS):  # a seed each: no prompt is ever sent twice
                serve = clusters["open" if arm == "open_flood" else "tenants"]
                figures = run_arm(arm, serve, model, keys, args, seed=100 * i + 10 * j)
                rounds[arm].append(figures)
                flood = figures.get("flood")
                extra = (
                    f"  flood: {flood['attempts_per_s']:.1f} attempts/s, "
                    f"{flood['admitted_per_s']:.2f} admitted/s {flood['statuses']}"
                    if flood
                    else ""
                )
                print(
                    f"round {i + 1} {arm:10} TTFT p50 {figures['p50_s']:.3f} s, "
                    f"p99 {figures['p99_s']:.3f} s{extra}",
                    flush=True,
                )
        return rounds
    finally:
        for serve in clusters.values():
            serve.stop()


def warm_args(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "requests": 1, "think": 0.0})


def summarize(rounds: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Medians over rounds, and each arm's p99 over the unloaded one's."""
    med = statistics.median
    out: dict[str, dict[str, float]] = {}
    base = med(r["p99_s"] for r in rounds["unloaded"])
    for arm, rs in rounds.items():
        out[arm] = {"p50_s": med(r["p50_s"] for r in rs), "p99_s": med(r["p99_s"] for r in rs)}
        out[arm]["p99_over_unloaded"] = out[arm]["p99_s"] / base
        if arm != "unloaded":
            for k in ("attempts_per_s", "admitted_per_s", "admitted_tokens_per_s"):
                out[arm][f"flood_{k}"] = med(r["flood"][k] for r in rs)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=20, help="steady requests per arm and round")
    p.add_argument("--think", type=float, default=0.2, help="s between steady requests")
    p.add_argument("--steady-prompt", type=int, default=128, help="tokens")
    p.add_argument("--flood-clients", type=int, default=4)
    p.add_argument("--flood-prompt", type=int, default=256, help="tokens")
    p.add_argument("--flood-max-tokens", type=int, default=32)
    p.add_argument("--flood-pause", type=float, default=0.2, help="s after a 429")
    p.add_argument("--flood-rpm", type=int, default=60, help="the flooder's requests a minute")
    p.add_argument("--flood-concurrent", type=int, default=2, help="the flooder's in flight")
    p.add_argument("--warmup", type=float, default=3.0, help="s of flood before measuring")
    p.add_argument(
        "--serve-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more pdserve serve flag for both clusters (repeatable), e.g. "
        "--serve-flag=--max-num-batched-tokens=64",
    )
    p.add_argument("--out", default=None, help="write the figures here as JSON")
    args = p.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tenant-flood-") as directory:
        rounds = run(args, Path(directory))
    results = summarize(rounds)
    print(
        f"\n{args.model}, 1P1D, steady {args.steady_prompt}-token prompts, medians of "
        f"{args.rounds} rounds of {args.requests} requests ({time.monotonic() - started:.0f} s)"
    )
    print(
        f"{'arm':12}{'TTFT p50 s':>12}{'TTFT p99 s':>12}{'p99/unloaded':>14}"
        f"{'flood admitted/s':>18}"
    )
    for arm, r in results.items():
        admitted = f"{r['flood_admitted_per_s']:18.2f}" if "flood_admitted_per_s" in r else ""
        print(
            f"{arm:12}{r['p50_s']:12.3f}{r['p99_s']:12.3f}{r['p99_over_unloaded']:14.2f}{admitted}"
        )
    if args.out:
        record = {"args": vars(args), "results": results, "rounds": rounds}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
