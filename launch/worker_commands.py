"""The command line of each worker ``pdserve serve`` starts: ``pdserve prefill|decode ...`` with
the engine flags serve was given, its share of the cores (``--threads``) and, with ``--pin``,
its own cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from pdserve.engine.core_board import SLOTS as BOARD_SLOTS
from pdserve.engine.kv_memory import ROLE_SHARES
from pdserve.launch.serve_api import served_name
from pdserve.runtime.tracing import otlp_flags

FORWARDED_ENGINE_FLAGS = (
    "dtype",
    "device",
    "attention_backend",
    "cpu_linear",
    "quantization",
    "quant_group_size",
    "quant_activations",
    "max_model_len",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_step_time",
    "tpot_target_ms",
    "prefill_age_bound_ms",
    "seed",
    "tp_timeout",
    "tp_staging_blocks",
    "num_speculative_tokens",
    "ngram_min",
    "ngram_max",
    "draft_quantization",
    "spec_switch",
)


def pdserve_command() -> list[str]:
    """The console script beside this Python, so ``ps`` shows ``pdserve <role> ...``."""
    script = Path(sys.executable).parent / "pdserve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pdserve.launch.cli"]


def worker_commands(args: argparse.Namespace, coordinator: str, model: str) -> list[list[str]]:
    """One ``pdserve prefill|decode ...`` command line per worker (the first ones with
    ``--autoscale``), worker ``i`` being ``<role>-<i>``; with versions of a model, each
    version's (``launch.versions``)."""
    if getattr(args, "version_specs", None):
        from pdserve.launch.versions import version_commands

        return version_commands(args, coordinator, worker_command, total_ranks(args))
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    if args.mode == "colocated":
        roles = ["decode"] * len(roles)
    return [
        worker_command(args, coordinator, model, role, i, f"{role}-{i}")
        for i, role in enumerate(roles)
    ]


def worker_command(
    args: argparse.Namespace, coordinator: str, model: str, role: str, slot: int, worker_id: str
) -> list[str]:
    """Worker ``slot``'s command line as ``role`` (``--pin``: the slot's cores). Threads: the
    cores split between the workers, or between ``--max-workers`` with ``--autoscale``."""
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // total_ranks(args))
    tp = role_tp(args, role)
    common = [
        f"--drain-timeout={args.drain_timeout}",
        f"--model={model}",
        f"--coordinator={coordinator}",
        f"--threads={threads}",
        f"--transfer-backend={args.transfer_backend}",
        f"--transfer-timeout={args.transfer_timeout}",
    ]
    if served_name(args):
        common.append(f"--served-model-name={served_name(args)}")
    common += otlp_flags(args)
    for flag in FORWARDED_ENGINE_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            common.append(f"--{flag.replace('_', '-')}={value}")
    common.append(f"--kv-cache-share={kv_share(args, role):.4g}")
    common += spec_flags(args, role)
    if tp > 1:  # a group of tp ranks, --threads each (the worker starts the others)
        common.append(f"--tensor-parallel-size={tp}")
    for switch in ("no_prefix_caching", "enforce_eager", "compile"):  # flags without a value
        if getattr(args, switch):
            common.append(f"--{switch.replace('_', '-')}")
    colocated = ["--colocated"] if args.mode == "colocated" else []
    cmd = [*pdserve_command(), role, *colocated, *common, f"--worker-id={worker_id}"]
    if getattr(args, "core_board", None) and slot < BOARD_SLOTS:  # idle workers lend cores
        cmd += [f"--core-board={args.core_board}", f"--core-slot={slot}"]
    if role == "prefill" and args.kv_fault:
        cmd.append(f"--kv-fault={args.kv_fault}")
    if role == "prefill" and args.kv_stream_chunks:
        cmd.append("--kv-stream-chunks")
    if role == "decode":
        cmd.append(f"--kv-failure-policy={args.kv_failure_policy}")
    if args.pin:  # the worker's ranks' cores (each rank pins itself to its own of them)
        first = (ranks_before(args, slot) * threads) % cores
        cpus = ",".join(str((first + k) % cores) for k in range(threads * tp))
        cmd = ["taskset", "-c", cpus, *cmd] if shutil.which("taskset") else cmd
    return cmd


def spec_flags(args: argparse.Namespace, role: str) -> list[str]:
    """``--speculative``: decode and colocated workers speculate; a prefill worker runs a
    draft model only to compute its prompt KV (n-gram needs nothing there)."""
    mode = getattr(args, "speculative", "off")
    if mode == "off" or (mode == "ngram" and role == "prefill" and args.mode != "colocated"):
        return []
    flags = [f"--speculative={mode}"]
    if mode == "draft" and args.draft_model:
        flags.append(f"--draft-model={args.draft_model}")
    return flags


def role_tp(args: argparse.Namespace, role: str) -> int:
    """The tensor-parallel size of a ``role`` worker: ``--prefill-tp`` / ``--decode-tp``,
    else ``--tp`` (all of them; colocated workers take it)."""
    own = None
    if args.mode != "colocated":
        own = getattr(args, "prefill_tp" if role == "prefill" else "decode_tp", None)
    return int(own or getattr(args, "tensor_parallel_size", 1) or 1)


def total_ranks(args: argparse.Namespace) -> int:
    """Processes running the model that serve starts (each worker's ranks), what the cores
    are split between; with ``--autoscale``, as many as ``--max-workers`` may be."""
    widest = max(role_tp(args, "prefill"), role_tp(args, "decode"))
    if args.max_workers:
        return int(args.max_workers) * widest
    return int(args.prefill) * role_tp(args, "prefill") + int(args.decode) * role_tp(args, "decode")


def ranks_before(args: argparse.Namespace, slot: int) -> int:
    """Ranks of the workers in slots before ``slot`` (prefill ones first)."""
    a, b = role_tp(args, "prefill"), role_tp(args, "decode")
    prefill = int(args.prefill)
    if slot <= prefill:
        return slot * a
    return prefill * a + (slot - prefill) * b


def kv_share(args: argparse.Namespace, role: str) -> float:
    """The share of the machine's memory a worker of ``role`` may give its KV cache when no
    budget is set (engine/kv_memory.py): ``--kv-cache-share``, else its role's share split
    between the workers of that role serve starts (with ``--autoscale``: as many as it may)."""
    if args.kv_cache_share is not None:
        return float(args.kv_cache_share)
    colocated = args.mode == "colocated"
    count: int
    if args.max_workers:
        count = args.max_workers
    elif colocated:
        count = args.prefill + args.decode
    else:
        count = args.prefill if role == "prefill" else args.decode
    return ROLE_SHARES["both" if colocated else role] / max(1, count)


def split_models(args: argparse.Namespace, models: list[str]) -> str:
    """``--model`` given once or more (directories): the generative one, whose prefill and
    decode pools serve starts (``args.model`` from here), and the embedding ones, an embed
    worker each (``args.embedding_models``). No generative model: no pools; more than one:
    a ``ValueError`` (one serve runs one model's pools)."""
    from pdserve.prefill.embed_main import is_embedding_model

    embedding = [m for m in models if is_embedding_model(m)]
    generative = [m for m in models if m not in embedding]
    if generative and getattr(args, "version_specs", None):
        raise ValueError(
            f"--model names a generative model ({generative[0]}) beside versions (NAME@VERSION="
            "DIR): serve the model as a version too, or start another serve for it"
        )
    if len(generative) > 1:
        raise ValueError(
            f"--model names {len(generative)} generative models ({', '.join(generative)}): "
            "one serve runs the prefill and decode pools of one; start another for the next"
        )
    if not generative and args.autoscale:
        raise ValueError("--autoscale sizes a generative model's pools: name one with --model")
    args.model = generative[0] if generative else ""
    args.embedding_models = embedding
    if not generative and not getattr(args, "version_specs", None):
        args.prefill = args.decode = 0
    return generative[0] if generative else ""


def embed_commands(args: argparse.Namespace, coordinator: str) -> list[list[str]]:
    """One ``pdserve prefill`` per embedding model (its worker id ``embed-<i>``): a worker
    with no KV cache, its threads a share of the cores beside the pools'."""
    models: list[str] = getattr(args, "embedding_models", [])
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // (total_ranks(args) + len(models)))
    return [
        [
            *pdserve_command(),
            "prefill",
            f"--model={model}",
            f"--coordinator={coordinator}",
            f"--threads={threads}",
            f"--drain-timeout={args.drain_timeout}",
            f"--transfer-backend={args.transfer_backend}",
            f"--worker-id=embed-{i}",
        ]
        for i, model in enumerate(models)
    ]
