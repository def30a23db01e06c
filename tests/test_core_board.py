"""Cores lent between the workers of one host (engine/core_board.py), and serve wiring it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from pdserve.engine import core_board
from pdserve.engine.core_board import BOARD_BYTES, CoreBoard
from pdserve.launch.serve import add_serve_args
from pdserve.launch.worker_commands import worker_commands


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(argv)


@pytest.fixture
def two_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(core_board, "REFRESH_S", 0.0)  # every call rereads the slots


def test_an_idle_worker_lends_its_threads_and_takes_them_back(tmp_path: Path, two_cores) -> None:
    path = tmp_path / "cores"
    decode = CoreBoard(path, 1, 1, max_rows=16)
    assert path.stat().st_size == BOARD_BYTES
    assert decode.threads() == 1  # alone on the board: its own thread
    prefill = CoreBoard(path, 0, 1)  # a new worker starts busy (loading, its first step)
    assert decode.threads() == 1
    prefill.set_busy(False)
    decode.set_busy(False)
    assert decode.threads() == 2 and prefill.threads() == 2  # both idle: each may take both
    decode.set_busy(True)
    assert decode.threads() == 2 and prefill.threads() == 1
    assert decode.threads(16) == 2 and decode.threads(17) == 1  # many streams keep their own
    prefill.set_busy(True)  # a prompt arrives: its core is back on the decode's next call
    assert decode.threads() == 1
    prefill.close()  # gone: counted busy, its core never borrowed on a stale flag
    assert decode.threads() == 1


def test_threads_are_capped_at_the_cores_this_process_may_use(tmp_path: Path, two_cores) -> None:
    path = tmp_path / "cores"
    me = CoreBoard(path, 3, 1)
    others = [CoreBoard(path, slot, 1) for slot in (0, 1, 2)]
    for other in others:
        other.set_busy(False)
    assert me.threads() == 2  # 1 + 3 idle, but two cores here
    others[0].set_busy(True)  # more workers than cores (autoscaling): one busy takes a core
    assert me.threads() == 1  # two idle, yet no core free beside the busy one and this one
    with pytest.raises(ValueError, match="slot must be in"):
        CoreBoard(path, core_board.SLOTS, 1)


def test_serve_gives_each_worker_a_slot_unless_pinned_or_told_not_to(tmp_path: Path) -> None:
    args = parse_args(["--model=tiny"])
    assert args.lend_cores
    args.core_board = tmp_path / "cores"
    cmds = worker_commands(args, "tcp://127.0.0.1:1", "m")
    slots = [next(a for a in c if a.startswith("--core-slot=")) for c in cmds]
    assert slots == ["--core-slot=0", "--core-slot=1"]
    assert all(f"--core-board={tmp_path / 'cores'}" in c for c in cmds)
    args.core_board = None  # --pin or --no-lend-cores: serve leaves it unset
    assert not any("--core-board" in a for c in worker_commands(args, "x", "m") for a in c)
    assert not parse_args(["--model=tiny", "--no-lend-cores"]).lend_cores
