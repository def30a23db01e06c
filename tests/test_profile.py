"""The planner's profile: interpolation, its JSON (round trip, hostile files refused), the
shipped profile, and ``pdserve profile`` on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.coordinator.profile import MAX_FILE_BYTES, Profile, shipped_profile

GRID = Profile(
    model="m",
    device="cpu",
    threads=1,
    block_size=16,
    kv_blocks=100,
    prefill=((100, 1.0), (200, 2.5), (400, 6.0)),
    decode=((1, 100, 0.01), (4, 100, 0.02), (16, 100, 0.05), (1, 1000, 0.02), (4, 1000, 0.05)),
)


@pytest.mark.parametrize(
    ("tokens", "seconds"),
    [
        (100, 1.0),
        (150, 1.75),
        (300, 4.25),
        (400, 6.0),
        (600, 9.5),  # past the last point: its segment's slope, 3.5 s / 200 tokens
        (50, 0.25),  # below the first: the first segment's line
        (10, 0.0),  # ... floored at zero
        (0, 0.0),
        (-3, 0.0),
    ],
)
def test_prefill_interpolation(tokens: int, seconds: float) -> None:
    assert GRID.prefill_seconds(tokens) == pytest.approx(seconds)


def test_prefill_extrapolation_never_cheaper_per_token_than_the_last_point() -> None:
    flat_end = _profile(prefill=((100, 1.0), (200, 2.0), (400, 2.0)))
    assert flat_end.prefill_seconds(600) == pytest.approx(3.0)  # 2.0 s / 400 tokens a token
    one = _profile(prefill=((100, 1.0),))
    assert (one.prefill_seconds(50), one.prefill_seconds(300)) == pytest.approx((0.5, 3.0))


@pytest.mark.parametrize(
    ("batch", "context", "seconds"),
    [
        (4, 100, 0.02),
        (10, 100, 0.035),
        (32, 100, 0.09),  # past the last batch: slope 0.03 s / 12 sequences
        (4, 550, 0.035),  # halfway between the two contexts
        (1, 50, 0.01),  # below the first context: the first's value
        (0, 100, 0.01),  # a batch of none costs a batch of one
        (1, 2000, 0.02 + 1000 * 0.01 / 900),  # past the last context: the two's slope
        (16, 1000, 0.17),  # the 1,000-token row extrapolated: 0.01 s a sequence
        (16, 550, (0.05 + 0.17) / 2),
    ],
)
def test_decode_interpolation(batch: int, context: int, seconds: float) -> None:
    assert GRID.decode_step_seconds(batch, context) == pytest.approx(seconds)


def test_decode_single_context_and_single_batch() -> None:
    row = _profile(decode=((1, 128, 0.01), (8, 128, 0.03)))
    assert row.decode_step_seconds(8, 5000) == pytest.approx(0.03)
    assert row.decode_step_seconds(4, 10) == pytest.approx(0.01 + 3 * 0.02 / 7)
    flat = _profile(decode=((4, 128, 0.02), (1, 256, 0.01), (2, 256, 0.012)))
    assert flat.decode_step_seconds(64, 128) == pytest.approx(0.02)  # one point: flat


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    GRID.save(path)
    assert Profile.load(path) == GRID
    assert Profile.from_json(json.loads(json.dumps(GRID.to_json()))) == GRID
    lines = path.read_text().splitlines()
    assert lines[4:6] == [' "threads": 1,', ' "tensor_parallel_size": 1,']
    assert lines[8:12] == [' "prefill": [', "  [100, 1.0],", "  [200, 2.5],", "  [400, 6.0]"]
    assert len(lines) == 21  # one point a line


def test_a_tensor_parallel_profile_round_trips_and_old_files_are_of_one_rank(
    tmp_path: Path,
) -> None:
    group = _profile(tensor_parallel_size=4)
    path = tmp_path / "tp4.json"
    group.save(path)
    assert ' "tensor_parallel_size": 4,' in path.read_text().splitlines()
    back = Profile.load(path)
    assert back == group and back.tensor_parallel_size == 4
    # written before profiles had a size: of one rank
    old = {k: v for k, v in GRID.to_json().items() if k != "tensor_parallel_size"}
    assert Profile.from_json(old) == GRID and Profile.from_json(old).tensor_parallel_size == 1


def _bad(**changes: Any) -> dict[str, Any]:
    data = GRID.to_json()
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({k: v for k, v in GRID.to_json().items() if k != "kv_blocks"}, "missing fields"),
        (_bad(extra=1), r"unknown fields \['extra'\]"),
        (_bad(version=2), "version 2 is not 1"),
        (_bad(version=True), "version True is not 1"),
        (_bad(model="../etc/passwd"), "not a valid model"),
        (_bad(model=""), "not a valid model"),
        (_bad(device="cuda; rm"), "not a valid device"),
        (_bad(threads=0), r"threads: 0 is not an integer in \[1, 4096\]"),
        (_bad(threads=True), "threads: True is not an integer"),
        (_bad(threads=1.5), "threads: 1.5 is not an integer"),
        (_bad(tensor_parallel_size=0), r"tensor_parallel_size: 0 is not an integer in \[1, 1024\]"),
        (_bad(tensor_parallel_size=1025), "tensor_parallel_size: 1025 is not an integer"),
        (_bad(tensor_parallel_size=True), "tensor_parallel_size: True is not an integer"),
        (_bad(tensor_parallel_size="2"), "tensor_parallel_size: '2' is not an integer"),
        (_bad(tensor_parallel_size=None), "tensor_parallel_size: None is not an integer"),
        (_bad(block_size=1 << 20), "block_size"),
        (_bad(kv_blocks="100"), "kv_blocks"),
        (_bad(prefill=[]), "prefill: 1 to 1024 points"),
        (_bad(prefill={"a": 1}), "prefill: a list of at most 1024 points"),
        (_bad(prefill=[[100, 1.0]] * 1025), "prefill: a list of at most 1024 points"),
        (_bad(prefill=[[200, 1.0], [100, 2.0]]), "strictly increasing"),
        (_bad(prefill=[[100, 1.0, 3]]), "each point is a list of 2 numbers"),
        (_bad(prefill=[[100, -1.0]]), r"-1.0 seconds is not in \(0, 100000\]"),
        (_bad(prefill=[[100, 0]]), "seconds is not in"),
        (_bad(prefill=[[100, float("nan")]]), "nan seconds is not in"),
        (_bad(prefill=[[100, float("inf")]]), "inf seconds is not in"),
        (_bad(prefill=[[100, "1.0"]]), "seconds must be a number"),
        (_bad(prefill=[[0, 1.0]]), "prefill prompt_tokens: 0 is not an integer"),
        (_bad(prefill=[[1 << 30, 1.0]]), "prefill prompt_tokens"),
        (_bad(decode=[[1, 100, 0.1], [1, 100, 0.2]]), "appears twice"),
        (_bad(decode=[[0, 100, 0.1]]), "decode batch: 0 is not an integer"),
        (_bad(decode=[[1, -1, 0.1]]), "decode context_tokens: -1"),
        (_bad(decode=[[1, 100]]), "each point is a list of 3 numbers"),
    ],
)
def test_malformed_profiles_refused(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Profile.from_json(data)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "p.json: Expecting property name"),
        (b"\xff\xfe{}", "p.json: 'utf-8' codec can't decode"),
        (b"[" * 100_000 + b"]" * 100_000, "p.json: "),
        (b" " * (MAX_FILE_BYTES + 1), f"larger than {MAX_FILE_BYTES} bytes"),
        (b'{"version": 1}', "p.json: profile: unknown fields"),
    ],
)
def test_bad_files_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        Profile.load(path)
    with pytest.raises(ValueError, match=r"no\.json: No such file"):
        Profile.load(tmp_path / "no.json")


def test_shipped_profile() -> None:
    profile = shipped_profile("smollm2-135m-instruct")
    assert profile is not None
    assert (profile.model, profile.device, profile.threads) == ("smollm2-135m-instruct", "cpu", 1)
    assert profile.tensor_parallel_size == 1  # the shipped file says none: one rank
    assert (profile.block_size, profile.kv_blocks) == (16, 364)  # 256 MiB of float32 KV
    assert [n for n, _ in profile.prefill] == [32, 128, 512, 1024, 2048]
    assert {(b, c) for b, c, _ in profile.decode} == {
        *((b, 128) for b in (1, 4, 16, 32, 40)),
        *((b, 512) for b in (1, 4, 11)),
        *((b, 1024) for b in (1, 4, 5)),
    }
    assert shipped_profile("tiny-llama-seed0") is None
    assert shipped_profile("../models/profiles/smollm2-135m-instruct") is None


def test_pdserve_profile_on_the_tiny_model(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    cmd = [sys.executable, "-m", "pdserve.launch.cli", "profile", "--model", str(tiny_dir)]
    cmd += ["--out", str(out), "--threads=1", "--block-size=4", "--num-kv-blocks=64"]
    cmd += ["--max-model-len=48", "--prompt-lens", "8", "32", "100", "--batches", "1", "4"]
    cmd += ["--contexts", "16", "64", "--repeats=2", "--steps=2", "--max-step-time=0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    profile = Profile.load(out)
    assert (profile.model, profile.threads, profile.block_size) == (tiny_dir.name, 1, 4)
    assert (profile.kv_blocks, profile.tensor_parallel_size) == (64, 1)
    assert [n for n, _ in profile.prefill] == [8, 32, 47]  # capped by --max-model-len
    # context 64 is capped at 47; 64 blocks hold 4 sequences of 48 tokens (12 blocks each)
    assert [(b, c) for b, c, _ in profile.decode] == [(1, 16), (4, 16), (1, 47), (4, 47)]
    table = done.stdout.splitlines()
    assert table[0] == f"{tiny_dir.name} on cpu, 1 threads, 64 KV blocks of 4 tokens"
    assert table[-1] == f"wrote {out} ({table[-1].split('(')[1]}"
    assert len(table) == 1 + 1 + 3 + 1 + 4 + 1


def test_pdserve_profile_measures_a_tensor_parallel_group(tiny_dir: Path, tmp_path: Path) -> None:
    """At --tensor-parallel-size 2 the group is measured whole (its rank 1 started here) and
    the file, named for its size by default, records the size."""
    cmd = [sys.executable, "-m", "pdserve.launch.cli", "profile", "--model", str(tiny_dir)]
    cmd += ["--tensor-parallel-size=2", "--dtype=float32", "--threads=1", "--block-size=4"]
    cmd += ["--num-kv-blocks=64", "--max-model-len=48", "--prompt-lens", "8", "32"]
    cmd += ["--batches", "1", "4", "--contexts", "16", "--repeats=1", "--steps=1"]
    cmd += ["--max-step-time=0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / f"profile-{tiny_dir.name}-tp2.json"
    profile = Profile.load(out)
    assert (profile.model, profile.tensor_parallel_size, profile.kv_blocks) == (
        tiny_dir.name,
        2,
        64,
    )
    assert [n for n, _ in profile.prefill] == [8, 32]
    assert [(b, c) for b, c, _ in profile.decode] == [(1, 16), (4, 16)]
    table = done.stdout.splitlines()
    assert table[0] == (
        f"{tiny_dir.name} on cpu, tensor-parallel size 2, 1 threads a rank, "
        "64 KV blocks of 4 tokens"
    )
    assert table[-1].startswith(f"wrote {out.name} (")


def _profile(**changes: Any) -> Profile:
    fields = {**GRID.__dict__, **changes}
    return Profile(**fields)
