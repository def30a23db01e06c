"""A rank past 0 of a tensor-parallel group: its part of the model, its heads of the KV cache,
and rank 0's commands until STOP.

Started by rank 0 on its host (``--engine-config``, rank 0's own configuration), or apart, on
another node, as ``pdserve tp-rank --tp-rank R --tensor-parallel-size N --tp-rendezvous
tcp://HOST:PORT`` with the engine flags rank 0 has (the group refuses to start if they differ
where it matters: engine/tp/launch.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import faulthandler
import logging
import os
import signal
import sys

import torch

from pdserve.engine.config import ConfigError, EngineConfig, ModelConfig, served_model_len
from pdserve.engine.tp.commands import follow
from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.launch import agree, config_from_json

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def run_rank(config: EngineConfig, rank: int) -> int:
    """Join the group as ``rank``, load this rank's part, follow rank 0 until STOP."""
    from pdserve.engine.model_runner import ModelRunner

    if config.device.startswith("cuda"):  # one GPU a rank: rank order on rank 0's host, the
        # host's own GPUs for a rank started apart (a pod of one GPU sees it as cuda:0)
        config = dataclasses.replace(config, device=f"cuda:{rank % torch.cuda.device_count()}")
    pin(config, rank)
    group = TPGroup(
        rank,
        config.tensor_parallel_size,
        config.tp_rendezvous,
        torch.device(config.device),
        config.tp_timeout_s,
        config.tp_join_timeout_s,
    )
    agree(group, config)
    model_config = ModelConfig.from_dir(config.model)
    runner = ModelRunner(config, model_config, served_model_len(config, model_config), group)
    follow(runner, group)
    group.close()
    return 0


def pin(config: EngineConfig, rank: int) -> None:
    """``--threads`` torch threads a rank; where the group was given exactly its cores (the
    process's allowed cores are ``threads`` x size: ``pdserve serve --pin``, taskset, a pod's
    cpuset), rank r takes cores [r·t, (r+1)·t) of them. Otherwise no pinning: groups sharing
    a host would all pin to its first cores. CUDA: the rank's GPU."""
    if config.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(config.device))
        return
    if not config.threads:
        return
    torch.set_num_threads(config.threads)
    cores = sorted(os.sched_getaffinity(0))
    need = config.threads * config.tensor_parallel_size
    if len(cores) != need:
        logger.info(
            "tensor-parallel rank %d not pinned: %d cores allowed, not %d ranks x %d threads",
            rank,
            len(cores),
            config.tensor_parallel_size,
            config.threads,
        )
        return
    mine = cores[rank * config.threads : (rank + 1) * config.threads]
    os.sched_setaffinity(0, mine)
    logger.info("tensor-parallel rank %d pinned to cores %s", rank, mine)


def _die_with(parent: int) -> None:
    """End when the process that started this rank ends (Linux), or now if it has."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        sys.exit(f"tensor-parallel rank: its rank 0 (pid {parent}) is gone")


def add_tp_rank_args(parser: argparse.ArgumentParser) -> None:
    """``pdserve tp-rank``: rank 0's engine flags, and this rank's place in the group."""
    from pdserve.engine.cli_args import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--tp-rank", type=int, required=True, help="this rank (1..N-1)")


def run_tp_rank(args: argparse.Namespace) -> int:
    """A rank started apart from its rank 0 (another node): it meets the group at
    ``--tp-rendezvous``."""
    from pdserve.engine.cli_args import engine_config_from_args

    faulthandler.enable()
    if not args.tp_rendezvous:
        raise SystemExit("pdserve tp-rank: --tp-rendezvous tcp://HOST:PORT (rank 0's) is needed")
    if not 0 < args.tp_rank < args.tensor_parallel_size:
        raise SystemExit(
            f"pdserve tp-rank: --tp-rank must be in [1, {args.tensor_parallel_size - 1}]"
        )
    try:
        config = engine_config_from_args(args)
    except (OSError, ConfigError) as e:
        raise SystemExit(f"pdserve tp-rank: {e}") from None
    return run_rank(config, args.tp_rank)


def main(argv: list[str] | None = None) -> int:
    faulthandler.enable()
    parser = argparse.ArgumentParser(prog="python -m pdserve.engine.tp.follower")
    parser.add_argument("--engine-config", required=True, help="rank 0's, as JSON")
    parser.add_argument("--tp-rank", type=int, required=True)
    parser.add_argument("--tp-rendezvous", required=True)
    parser.add_argument("--parent-pid", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-rank %(message)s")
    if args.parent_pid:
        _die_with(args.parent_pid)
    try:
        config = config_from_json(args.engine_config)
    except (ValueError, TypeError, ConfigError) as e:
        raise SystemExit(f"tensor-parallel rank {args.tp_rank}: bad --engine-config: {e}") from None
    config = dataclasses.replace(config, tp_rendezvous=args.tp_rendezvous)
    return run_rank(config, args.tp_rank)


if __name__ == "__main__":
    sys.exit(main())
