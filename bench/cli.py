"""``pdserve bench``: the flags, and the entry point that reports bad ones cleanly.

    pdserve bench --base-url http://127.0.0.1:8000 --dataset random --random-input-len 256 \\
        --random-output-len 64 --num-prompts 50 --request-rate 4 --slo tpot:50
    pdserve bench --dataset mixed --request-rate 1,2,4 --slo tpot:80 --plot out/ \\
        --save-result out/sweep.json
    pdserve bench --dataset multi-turn --multi-turn-conversations 64 --multi-turn-turns 5 \\
        --max-concurrency 16 --tokenizer MODEL_DIR --ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

import httpx

from pdserve.bench.client import ENDPOINTS


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    _add_target_args(parser.add_argument_group("target (any OpenAI-compatible server)"))
    _add_workload_args(parser.add_argument_group("workload"))
    _add_arrival_args(parser.add_argument_group("arrivals"))
    _add_output_args(parser.add_argument_group("metrics and output"))


def _add_target_args(t: argparse._ArgumentGroup) -> None:
    t.add_argument("--base-url", default="http://127.0.0.1:8000")
    t.add_argument(
        "--endpoint",
        default=None,
        choices=ENDPOINTS,
        help="default /v1/completions (multi-turn: /v1/chat/completions)",
    )
    t.add_argument("--model", default=None, help="default: the first id of /v1/models")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    t.add_argument("--extra-body", type=_json_object, default={}, help="JSON merged into bodies")
    t.add_argument("--temperature", type=float, default=None)
    t.add_argument("--request-timeout", type=float, default=3600.0, help="seconds")


def _add_workload_args(w: argparse._ArgumentGroup) -> None:
    w.add_argument(
        "--dataset",
        default="random",
        choices=["random", "shared-prefix", "mixed", "jsonl", "multi-turn"],
    )
    w.add_argument("--dataset-path", default=None, help="the jsonl file")
    w.add_argument(
        "--tokenizer",
        default=None,
        help="model dir or tokenizer.json: token-level prompts (else calibrated word text)",
    )
    w.add_argument("--num-prompts", type=int, default=None, help="default 100 (mixed: streams)")
    w.add_argument("--random-input-len", type=int, default=256)
    w.add_argument("--random-output-len", type=int, default=128)
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument("--shared-prefix-len", type=int, default=512)
    w.add_argument("--shared-prefix-groups", type=int, default=4)
    w.add_argument("--mixed-stream-input-len", type=int, default=32)
    w.add_argument("--mixed-stream-output-len", type=int, default=256)
    w.add_argument("--mixed-burst-input-len", type=int, default=1024)
    w.add_argument("--mixed-burst-output-len", type=int, default=16)
    w.add_argument("--mixed-burst-size", type=int, default=4)
    w.add_argument("--mixed-burst-interval", type=float, default=5.0, help="seconds")
    w.add_argument("--multi-turn-conversations", type=int, default=32)
    w.add_argument("--multi-turn-turns", type=int, default=4, help="turns per conversation")
    w.add_argument(
        "--multi-turn-system-len", type=int, default=512, help="shared system prompt, tokens"
    )
    w.add_argument("--multi-turn-user-len", type=int, default=64, help="each user message")
    w.add_argument("--multi-turn-output-len", type=int, default=64, help="each answer")
    w.add_argument(
        "--multi-turn-think-time", type=float, default=0.0, help="s between answer and next turn"
    )
    w.add_argument("--ignore-eos", action="store_true")
    w.add_argument("--seed", type=int, default=0)


def _add_arrival_args(a: argparse._ArgumentGroup) -> None:
    a.add_argument(
        "--request-rate", default="inf", help="req/s, Poisson; 'inf'; or a list: 1,2,4,8"
    )
    a.add_argument(
        "--sweep", action="store_true", help="synchronous, max throughput, then rates between"
    )
    a.add_argument("--sweep-points", type=int, default=4)
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a.add_argument(
        "--max-concurrency", type=int, default=None, help="multi-turn: conversations in flight"
    )
    a.add_argument("--duration", type=float, default=None, help="stop sending after S seconds")
    a.add_argument("--warmup", type=int, default=0, help="requests sent first, not measured")


def _add_output_args(m: argparse._ArgumentGroup) -> None:
    m.add_argument(
        "--slo", "--goodput", nargs="+", default=None, metavar="NAME:MS", help="ttft tpot e2el"
    )
    m.add_argument("--metric-percentiles", default="90,99")
    m.add_argument("--save-result", default=None, metavar="FILE")
    m.add_argument("--save-detailed", action="store_true", help="per-request lists too")
    m.add_argument("--plot", default=None, metavar="DIR", help="PNG charts")
    m.add_argument("--no-progress", action="store_true")


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def run_bench(args: argparse.Namespace) -> int:
    from pdserve.bench.harness import run

    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    try:
        rows = asyncio.run(run(args))
    except (ValueError, FileNotFoundError, httpx.HTTPError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    return 1 if any(row["completed"] == 0 for row in rows) else 0
