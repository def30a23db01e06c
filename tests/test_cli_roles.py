"""The role subcommands exist, and the torch-free roles stay torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = (
    "import sys; from pdserve.launch.cli import main\n"
    "try:\n    main([{role!r}, '--help'])\nexcept SystemExit:\n    pass\n"
    "print('torch' in sys.modules)"
)


@pytest.mark.parametrize("role", ["coordinator", "gateway"])
def test_torch_free_roles(role: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK.format(role=role)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("role", ["prefill", "decode", "serve"])
def test_worker_roles_have_their_flags(role: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.launch.cli", role, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--model" in out.stdout and "--max-num-batched-tokens" in out.stdout
