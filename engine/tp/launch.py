"""Starting a tensor-parallel group: rank 0 starts the others on its host (or waits for ranks
started apart, ``pdserve tp-rank``), then every rank checks that the group agrees.

    rank 0 (LLMEngine)                          ranks 1..N-1
    start_group(config)
      no --tp-rendezvous: a private directory,  python -m pdserve.engine.tp.follower
      a file store in it; spawns the others ──▶   --engine-config JSON --tp-rank r ...
      TPGroup(0, ...) ◀──── rendezvous ────────▶ TPGroup(r, ...)
      agree(): model files, weights' form, sizes, device kind: all alike, or every rank
      refuses to start naming the difference
      stop(): STOP to every rank at exit (a rank outliving rank 0 dies with it: its parent
      death signal, or its next collective failing)
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pdserve.engine.tp.group import Command, GroupFailed, TPGroup

logger = logging.getLogger(__name__)

_WEIGHT_HEAD = 1 << 20  # bytes of each weight file hashed (with every file's name and size)


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    d: dict[str, Any] = json.loads(text)
    d["cache"] = CacheConfig(**d["cache"])
    d["scheduler"] = SchedulerConfig(**d["scheduler"])
    d["speculative"] = SpeculativeConfig(**d["speculative"])
    return EngineConfig(**d)


def start_group(config: EngineConfig) -> TPGroup:
    """Rank 0's group: the other ranks spawned here (no ``tp_rendezvous``) or awaited."""
    rendezvous, spawned, private = config.tp_rendezvous, [], None
    if not rendezvous:
        private = tempfile.mkdtemp(prefix="pdserve-tp-")  # mode 0700: this user's alone
        rendezvous = f"file://{private}/store"
        spawned = [
            _spawn(config, rank, rendezvous) for rank in range(1, config.tensor_parallel_size)
        ]
    try:
        group = TPGroup(
            0,
            config.tensor_parallel_size,
            rendezvous,
            _device(config),
            config.tp_timeout_s,
            config.tp_join_timeout_s,
        )
        agree(group, config)
    except BaseException:
        for proc in spawned:
            proc.kill()
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        raise
    group.stop = functools.partial(stop, group, spawned, private)
    atexit.register(group.stop)
    return group


def stop(group: TPGroup, spawned: list[subprocess.Popen[bytes]], private: str | None) -> None:
    """STOP to every rank, then wait for those spawned here (killed if they linger), and
    remove the rendezvous directory; once."""
    if group.stopped:
        return
    group.stopped = True
    try:
        with group.lock:
            group.command(Command.STOP)
    except GroupFailed:
        pass  # a rank is gone already
    for proc in spawned:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    group.close()
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)


def _spawn(config: EngineConfig, rank: int, rendezvous: str) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "pdserve.engine.tp.follower",
        "--engine-config",
        config_to_json(config),
        "--tp-rank",
        str(rank),
        "--tp-rendezvous",
        rendezvous,
        "--parent-pid",
        str(os.getpid()),
    ]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)


def _device(config: EngineConfig) -> torch.device:
    return torch.device(config.device)


def fingerprint(config: EngineConfig) -> dict[str, str]:
    """What every rank of a group must share: the model's files, its weights' form, the
    cache's block size, the group's size and the kind of device."""
    return {
        "model files": model_digest(Path(config.model)),
        "dtype": config.dtype,
        "quantization": f"{config.quantization} (group {config.quant_group_size})",
        "quantized layers' activations": config.quant_activations,
        "block size": str(config.cache.block_size),
        "max model len": str(config.max_model_len),
        "tensor parallel size": str(config.tensor_parallel_size),
        "device kind": _device(config).type,
    }


def model_digest(path: Path) -> str:
    """A digest of a model directory: each file's name and size, config.json whole, and the
    first MiB of every other file (weights of another checkpoint differ there)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    for file in files:
        rel = file.relative_to(path).as_posix()
        h.update(f"{rel}\0{file.stat().st_size}\0".encode())
        with file.open("rb") as f:
            h.update(f.read() if rel == "config.json" else f.read(_WEIGHT_HEAD))
    return f"{path.name}:{h.hexdigest()[:16]}"


def agree(group: TPGroup, config: EngineConfig) -> None:
    """``GroupFailed`` on every rank, naming each difference, unless all ranks' fingerprints
    are alike."""
    mine = fingerprint(config)
    theirs = [json.loads(b) for b in group.all_gather_bytes(json.dumps(mine).encode())]
    diffs = []
    for key, value in theirs[0].items():
        others = [f"rank {r}: {fp.get(key)}" for r, fp in enumerate(theirs) if fp.get(key) != value]
        if others:
            diffs.append(f"{key} (rank 0: {value}; {'; '.join(others)})")
    if diffs:
        raise GroupFailed(
            f"tensor-parallel rank {group.rank}: the group's ranks disagree, refusing to start: "
            + ", ".join(diffs)
        )
