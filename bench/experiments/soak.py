"""Soak: a bounded sustained run with faults, counting hung requests and leaked blocks.

Starts ``pdserve serve`` (1 prefill + 2 decode, injected KV corruption, checksums on), then
keeps ``--clients`` streaming clients busy for ``--duration`` seconds: some clients give up
mid-stream, one decode worker is killed (kill -9) a third of the way in and the prefill worker
two thirds in (``serve`` restarts both; ``--kill`` chooses). Prints requests completed, failed
cleanly, hung (must be 0), blocks leaked (must be 0) and each role's RSS at start and end; and,
for each window between kills, the requests that began in it by outcome: ``refused`` (an error
status before any token: a new request the cluster could not take) apart from ``failed in
flight`` (an error event after the stream began: a stream on the killed worker).

    .venv/bin/python bench/experiments/soak.py                  # 120 s, tiny model
    .venv/bin/python bench/experiments/soak.py --duration 600 --model DIR
    .venv/bin/python bench/experiments/soak.py --model MODEL_DIR --kv-fault none \
        --kill prefill-0@0.5              # the only prefill worker killed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from pdserve.bench.client import sse_lines
from pdserve.bench.experiments.cluster import ServeProcess


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: built-in tiny)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--kv-fault", default="corrupt:0.1")
    p.add_argument(
        "--hang-after", type=float, default=30.0, help="a stream silent this long counts as hung"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kill",
        default="decode-1@0.333,prefill-0@0.667",
        help="WORKER@FRACTION,...: each killed (kill -9) that far into the run",
    )
    p.add_argument("--serve-flags", default="", help="more flags for pdserve serve")
    return p.parse_args()


def kills(spec: str) -> list[tuple[float, str]]:
    """``WORKER@FRACTION,...`` -> (fraction, worker), in time order."""
    out = []
    for part in filter(None, spec.split(",")):
        victim, _, fraction = part.partition("@")
        out.append((float(fraction), victim))
    return sorted(out)


def roles(serve_pid: int) -> dict[str, int]:
    """worker id (or role) -> pid, for the processes ``serve`` started."""
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True
    ).stdout
    found: dict[str, int] = {}
    for line in out.splitlines():
        pid, ppid, *args = line.split()
        if int(ppid) != serve_pid:
            continue
        wid = next((a.split("=", 1)[1] for a in args if a.startswith("--worker-id=")), None)
        role = next((a for a in args if a in ("coordinator", "gateway")), None)
        name = wid or role
        if name:
            found[name] = int(pid)
    return found


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    kib = re.search(r"VmRSS:\s+(\d+)", status)
    return int(kib.group(1)) / 1024 if kib else float("nan")


def used_blocks(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    pattern = r'^pdserve_kv_blocks_used\{[^}]*worker="([^"]+)"[^}]*\} (\S+)$'
    return {w: float(v) for w, v in re.findall(pattern, text, re.MULTILINE)}


async def client(
    base: str,
    model: str,
    stop_at: float,
    rng: random.Random,
    tally: Counter[str],
    hang_after: float,
    begun: list[tuple[float, str]],
) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(hang_after)) as http:
        while time.monotonic() < stop_at:
            give_up = rng.random() < 0.2
            body = {
                "model": model,
                "prompt": f"soak {rng.random()}",
                "stream": True,
                "max_tokens": rng.randint(8, 200),
                "ignore_eos": True,
            }
            outcome, at = "hung", time.monotonic()
            try:
                async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        outcome = "failed cleanly" if "error" in r.json() else "bad error"
                        begun.append((at, "refused" if "error" in r.json() else outcome))
                    else:
                        outcome = await _read(r, give_up, rng)
                        window = "failed in flight" if outcome == "failed cleanly" else outcome
                        begun.append((at, window))
            except httpx.TimeoutException:
                outcome = "hung"
                begun.append((at, outcome))
            except httpx.HTTPError as e:
                outcome = f"connection error ({type(e).__name__})"
                begun.append((at, outcome))
            tally[outcome] += 1


async def _read(r: httpx.Response, give_up: bool, rng: random.Random) -> str:
    chunks, limit, last = 0, rng.randint(1, 20), None
    async for line in sse_lines(r):
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "failed cleanly" if last and "error" in last else "completed"
        last = json.loads(line[6:])
        chunks += 1
        if give_up and chunks >= limit:
            return "client gave up"
    return "stream ended without [DONE]"


async def load(
    base: str,
    model: str,
    args: argparse.Namespace,
    serve_pid: int,
    begun: list[tuple[float, str]],
    killed: list[tuple[float, str]],
) -> Counter[str]:
    """Run the clients; ``begun`` gets each request's start and window outcome, ``killed``
    each kill's time and victim."""
    tally: Counter[str] = Counter()
    start = time.monotonic()
    stop_at = start + args.duration
    rng = random.Random(args.seed)
    tasks = [
        asyncio.create_task(
            client(
                base,
                model,
                stop_at,
                random.Random(rng.random()),
                tally,
                args.hang_after,
                begun,
            )
        )
        for _ in range(args.clients)
    ]
    for fraction, victim in kills(args.kill):
        await asyncio.sleep(max(0.0, start + args.duration * fraction - time.monotonic()))
        pid = roles(serve_pid).get(victim)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append((time.monotonic(), victim))
            print(f"[{time.monotonic() - start:6.1f}s] killed {victim} (pid {pid})", flush=True)
    await asyncio.gather(*tasks)
    return tally


def main() -> None:
    args = parse_args()
    from pdserve.models.make_model import default_model_dir

    model = args.model or str(default_model_dir("tiny"))
    flags = ["--prefill=1", "--decode=2", *args.serve_flags.split()]
    if args.kv_fault != "none":
        flags.append(f"--kv-fault={args.kv_fault}")
    cluster = ServeProcess(model, flags)
    serve, base = cluster.proc, cluster.url
    begun: list[tuple[float, str]] = []
    killed: list[tuple[float, str]] = []
    try:
        rss_start = {name: rss_mib(pid) for name, pid in roles(serve.pid).items()}
        tally = asyncio.run(load(base, Path(model).name, args, serve.pid, begun, killed))
        time.sleep(3)  # heartbeats catch up
        leaked = sum(used_blocks(base).values())
        rss_end = {name: rss_mib(pid) for name, pid in roles(serve.pid).items()}
    finally:
        cluster.stop()
    print(f"\nsoak: {args.duration:.0f}s, {args.clients} clients, kv fault {args.kv_fault}")
    for outcome in ("completed", "client gave up", "failed cleanly", "hung"):
        print(f"  {outcome:<28} {tally.get(outcome, 0):>6}")
    for outcome, n in sorted(tally.items()):
        if outcome not in ("completed", "client gave up", "failed cleanly", "hung"):
            print(f"  {outcome:<28} {n:>6}")
    print(f"  {'blocks leaked':<28} {leaked:>6.0f}")
    print(f"  {'role':<14} {'RSS start MiB':>14} {'RSS end MiB':>12}")
    for name in sorted(rss_end):
        print(f"  {name:<14} {rss_start.get(name, float('nan')):>14.1f} {rss_end[name]:>12.1f}")
    print_windows(begun, killed)
    ok = tally.get("hung", 0) == 0 and leaked == 0
    sys.exit(0 if ok else 1)


def print_windows(begun: list[tuple[float, str]], killed: list[tuple[float, str]]) -> None:
    """The requests begun in each window (from the start, then from each kill on) by outcome."""
    edges = [(float("-inf"), "from the start")] + [(at, f"after {w} killed") for at, w in killed]
    outcomes = ("completed", "client gave up", "refused", "failed in flight", "hung")
    print(f"  {'requests begun':<26}" + "".join(f"{o:>18}" for o in outcomes))
    for i, (edge, name) in enumerate(edges):
        end = edges[i + 1][0] if i + 1 < len(edges) else float("inf")
        counts = Counter(o for at, o in begun if edge <= at < end)
        print(f"  {name:<26}" + "".join(f"{counts.get(o, 0):>18}" for o in outcomes))
    for at, w in killed:  # the refusals right after a kill: how long new requests failed
        refused = [t - at for t, o in begun if o == "refused" and t >= at]
        if refused:
            span = f"+{min(refused):.1f} s to +{max(refused):.1f} s"
            print(f"  after {w} killed: new requests refused from {span}")


if __name__ == "__main__":
    main()
