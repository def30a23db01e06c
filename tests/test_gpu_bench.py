"""bench/micro/gpu.py where CUDA is off (hidden from it on a GPU machine): exits 0 at once and
prints its whole table, every row skipped with engine/platform.py's reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = [
    "device copy bandwidth",
    "bf16 matmul rate",
    "flashinfer vs torch attention (rel err)",
    "greedy tokens, disagg nixl vs engine",
    "decode step, batch 1 (8B shapes)",
    "decode step, batch 8 (8B shapes)",
    "decode step, batch 64 (8B shapes)",
    "prefill 4,096 tokens (8B shapes)",
    "host syncs per decode step",
    "transformers.generate side by side",
    "nixl transfer bandwidth",
    "nccl transfer",
    "TTFT / TPOT via pdserve bench",
    "layer-by-layer transfer overlap",
    "tp2 greedy tokens vs TP 1 (NCCL)",
    "tp2 decode step, batch 1 (1B shapes)",
]


def test_without_cuda_every_row_is_skipped_with_its_reason(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "micro" / "gpu.py"), f"--json={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    caps = result["capabilities"]
    cuda_reason = caps["cuda"][1]
    assert caps["cuda"][0] is False
    assert cuda_reason.endswith("is a CPU-only build") or cuda_reason == (
        "torch.cuda.is_available() is False (no driver or no visible GPU)"
    )
    for name in ("flashinfer", "nixl", "nccl", "two_gpus"):
        assert caps[name][0] is False
        assert caps[name][1].startswith(f"no CUDA ({cuda_reason})")
    rows = result["rows"]
    assert [r["check"] for r in rows] == CHECKS
    for row in rows:  # no GPU work was attempted: every row was skipped, for its reason
        assert row["result"] == f"skipped: {caps[row['needs']][1]}"
    lines = done.stdout.strip().splitlines()
    assert lines[0].split(" | ")[0].strip() == "check"
    table = [line.split(" | ") for line in lines[2:]]
    assert [cells[0].strip() for cells in table] == CHECKS  # the table is the last thing printed
    assert [cells[1].strip() for cells in table] == [r["result"] for r in rows]
