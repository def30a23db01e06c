"""The benchmark as a whole: resolve the target, make the prompts, warm up, run each rate,
print, save and plot."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any  # result rows are JSON: values of every type, read by key

import httpx
import numpy as np

from pdserve.bench import datasets as ds
from pdserve.bench.client import Target, first_model, prompt_tokens
from pdserve.bench.metrics import RequestOutput, Slo, detail, parse_slo, per_turn, summarize
from pdserve.bench.multi_turn import MultiTurnSpec, build_conversations, run_conversations
from pdserve.bench.prompts import PromptMaker, TokenPrompts, WordPrompts, calibrate, load_tokenizer
from pdserve.bench.report import Progress, result_table, save_json, sweep_header, sweep_row
from pdserve.bench.runner import RunSpec, make_client, run_requests
from pdserve.bench.sweep import best_rate, effective_rate, parse_rates, rates_between

WARMUP_SEED_OFFSET = 10_000


@dataclass(frozen=True)
class Stage:
    rate: float
    max_concurrency: int | None
    name: str  # "rate" | "sync" | "throughput"


def num_requests(args: argparse.Namespace, rate: float) -> int:
    """``--num-prompts``, else enough for ``--duration`` at ``rate`` (unsent ones cost nothing
    but their making), else 100."""
    if args.num_prompts is not None:
        return int(args.num_prompts)
    if args.duration is None:
        return 100
    return math.ceil(rate * args.duration * 1.5) + 10 if math.isfinite(rate) else 1000


def build_requests(
    args: argparse.Namespace, maker: PromptMaker | None, rate: float, n: int, seed: int
) -> list[ds.BenchRequest]:
    rng = np.random.default_rng(seed)
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return ds.jsonl_requests(args.dataset_path, args.random_output_len, maker)[
            : args.num_prompts
        ]
    maker = needed(maker, args.dataset)
    ratio = args.random_range_ratio
    if args.dataset == "random":
        return ds.random_requests(
            maker, n, args.random_input_len, args.random_output_len, ratio, rng
        )
    if args.dataset == "shared-prefix":
        return ds.shared_prefix_requests(
            maker,
            n,
            args.shared_prefix_groups,
            args.shared_prefix_len,
            args.random_input_len,
            args.random_output_len,
            ratio,
            rng,
        )
    spec = ds.MixedSpec(
        args.mixed_stream_input_len,
        args.mixed_stream_output_len,
        args.mixed_burst_input_len,
        args.mixed_burst_output_len,
        args.mixed_burst_size,
        args.mixed_burst_interval,
    )
    horizon = args.duration if args.duration else (n / rate if math.isfinite(rate) else 0.0)
    return ds.mixed_requests(maker, n, spec, horizon, rng)


def needed(maker: PromptMaker | None, dataset: str) -> PromptMaker:
    """The prompt maker every dataset but jsonl (whose rows bring their text) makes prompts
    with; ``make_prompts`` gives one to each of them."""
    if maker is None:
        raise ValueError(f"--dataset {dataset} makes its prompts: it needs a prompt maker")
    return maker


def multi_turn_spec(args: argparse.Namespace) -> MultiTurnSpec:
    return MultiTurnSpec(
        args.multi_turn_conversations,
        args.multi_turn_turns,
        args.multi_turn_system_len,
        args.multi_turn_user_len,
        args.multi_turn_output_len,
        args.random_range_ratio,
        args.multi_turn_think_time,
    )


def endpoint(args: argparse.Namespace) -> str:
    chat = "/v1/chat/completions"
    if args.dataset != "multi-turn":
        return args.endpoint or "/v1/completions"
    if args.endpoint not in (None, chat):
        raise ValueError(f"--dataset multi-turn needs --endpoint {chat}")
    return chat


async def run_stage(
    args: argparse.Namespace,
    client: httpx.AsyncClient,
    target: Target,
    maker: PromptMaker | None,
    spec: RunSpec,
    progress: Progress | None,
    n: int,
    warmup: bool = False,
) -> tuple[list[RequestOutput], float]:
    """One stage's outputs and duration: the conversations of a multi-turn run, else ``n``
    requests. A warm-up sends ``n`` requests: no bursts; multi-turn: ``n`` first turns."""
    if args.dataset == "multi-turn":
        mt = multi_turn_spec(args)
        if warmup:
            mt = replace(mt, conversations=n, turns=1)
        convs = build_conversations(
            needed(maker, args.dataset), mt, np.random.default_rng(spec.seed)
        )
        return await run_conversations(client, target, convs, spec, mt.think_time, progress)
    requests = build_requests(args, maker, spec.rate, n, spec.seed)
    if warmup:
        requests = requests[:n]
    return await run_requests(client, target, requests, spec, progress)


async def make_prompts(
    args: argparse.Namespace, client: httpx.AsyncClient, target: Target
) -> PromptMaker | None:
    if args.tokenizer:
        return TokenPrompts(load_tokenizer(args.tokenizer))
    if args.dataset == "jsonl":
        return None  # the server's usage counts the tokens
    tokens_per_word = await calibrate(partial(prompt_tokens, client, target), args.seed)
    print(f"calibrated prompts: {tokens_per_word:.3f} tokens per word", file=sys.stderr)
    return WordPrompts(tokens_per_word)


def stages(args: argparse.Namespace) -> list[Stage]:
    if args.sweep:
        return [Stage(math.inf, 1, "sync"), Stage(math.inf, args.max_concurrency, "throughput")]
    return [Stage(r, args.max_concurrency, "rate") for r in parse_rates(args.request_rate)]


def metadata(args: argparse.Namespace, target: Target, stage: Stage, slo: Slo) -> dict[str, Any]:
    """vLLM's run fields (``request_rate`` is the string ``"inf"`` when unbounded)."""
    meta = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if target.chat else "openai",
        "base_url": target.base_url,
        "endpoint": target.endpoint,
        "model_id": target.model,
        "tokenizer_id": args.tokenizer,
        "dataset": args.dataset,
        "request_rate": stage.rate if math.isfinite(stage.rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": stage.max_concurrency,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "slo_ms": {k: v for k, v in vars(slo).items() if v is not None},
        "sweep_stage": stage.name,
    }
    if args.dataset == "multi-turn":
        meta["multi_turn"] = asdict(multi_turn_spec(args))
    return meta


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every stage's result (with ``rate`` and, when detailed, the per-request lists)."""
    slo = parse_slo(args.slo)
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    plan = stages(args)
    path = endpoint(args)
    if args.dataset == "multi-turn":
        multi_turn_spec(args)  # bad knobs fail before any request
    async with make_client(args.request_timeout) as client:
        model = args.model or await first_model(client, args.base_url, args.api_key)
        target = Target(
            args.base_url,
            path,
            model,
            args.api_key,
            args.extra_body,
            args.ignore_eos,
            args.temperature,
        )
        maker = await make_prompts(args, client, target)
        if args.warmup:
            await warm_up(args, client, target, maker)
        rows: list[dict[str, Any]] = []
        runs: list[tuple[str, list[RequestOutput]]] = []
        sweep = len(plan) > 1 or args.sweep
        if sweep:
            print(sweep_header())
        for i, stage in enumerate(plan):  # --sweep appends its rates after the first two
            spec = RunSpec(
                stage.rate, args.burstiness, stage.max_concurrency, args.duration, args.seed + i
            )
            label = f"{stage.name} {stage.rate:g}: " if sweep else ""
            progress = None if args.no_progress else Progress(label)
            n = num_requests(args, stage.rate)
            outputs, duration = await run_stage(args, client, target, maker, spec, progress, n)
            result = {**metadata(args, target, stage, slo), "num_prompts": len(outputs)}
            result.update(summarize(outputs, duration, slo, percentiles))
            if args.dataset == "multi-turn":
                result["per_turn"] = per_turn(outputs, args.multi_turn_turns, percentiles)
            result["rate"] = effective_rate(stage.rate, result)
            if args.save_detailed:
                result.update(detail(outputs))
            rows.append(result)
            runs.append((f"{stage.name} {result['rate']:.2f}/s", outputs))
            print(sweep_row(result) if sweep else result_table(result, percentiles), flush=True)
            if args.sweep and i == 1:
                between = rates_between(rows[0]["rate"], rows[1]["rate"], args.sweep_points)
                plan += [Stage(r, args.max_concurrency, "rate") for r in between]
    finish(args, rows, runs, sweep)
    return rows


async def warm_up(
    args: argparse.Namespace, client: httpx.AsyncClient, target: Target, maker: PromptMaker | None
) -> None:
    """``--warmup`` requests of the workload's shape (other prompts), all at once; mixed:
    no bursts; multi-turn: first turns, under another system prompt."""
    spec = RunSpec(max_concurrency=args.max_concurrency, seed=args.seed + WARMUP_SEED_OFFSET)
    outputs, _ = await run_stage(args, client, target, maker, spec, None, args.warmup, True)
    failed = sum(not o.success for o in outputs)
    print(f"warmup: {len(outputs)} requests, {failed} failed", file=sys.stderr)


def finish(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    runs: list[tuple[str, list[RequestOutput]]],
    sweep: bool,
) -> None:
    best = best_rate(rows) if sweep else None
    if sweep and args.slo:
        found = "none" if best is None else f"{best:g} req/s"
        print(f"highest rate with >= 90% SLO attainment: {found}")
    if args.save_result:
        if sweep:
            # the command line it was run with (``pdserve bench ...``), not this process's
            default = shlex.join(["pdserve", *sys.argv[1:]])
            command = str(getattr(args, "command_line", default))
            save_json(
                args.save_result, {"command": command, "rows": rows, "max_rate_meeting_slo": best}
            )
        else:
            save_json(args.save_result, rows[0])
    if args.plot:
        from pdserve.bench.plots import plot_cdfs, plot_sweep

        Path(args.plot).mkdir(parents=True, exist_ok=True)
        plot_cdfs(runs, args.plot)
        if sweep:
            plot_sweep({"sweep": rows}, Path(args.plot) / "sweep.png")
