"""``pdserve generate``: one JSON object per prompt, the same tokens as the engine."""

from __future__ import annotations

import json
import subprocess
import sys

from pdserve.engine.tokenizer import Tokenizer
from pdserve.launch.cli import main
from tests.engine_util import greedy, make_engine


def test_generate_json_matches_engine(tiny_dir, capsys) -> None:
    prompts = ["The quick brown fox", "Ünïcödé and 数字 123"]
    rc = main(["generate", "--model", str(tiny_dir), "--json", "--max-tokens", "6", *prompts])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in lines] == prompts
    tok = Tokenizer.from_dir(tiny_dir)
    engine = make_engine(tiny_dir, block_size=16)
    for record, prompt in zip(lines, prompts, strict=True):
        # without --ignore-eos the CLI stops at an eos as the engine does: the same tokens
        out = engine.generate([tok.encode(prompt)], greedy(6, ignore_eos=False))[0]
        assert out.new_token_ids  # the premise: there is something to compare
        assert record["token_ids"] == out.new_token_ids
        assert record["text"] == tok.decode(record["token_ids"])


def test_generate_reports_bad_model_cleanly(tmp_path, capsys) -> None:
    rc = main(["generate", "--model", str(tmp_path / "missing"), "hello"])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_console_script_runs(tiny_dir) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.launch.cli",
            "generate",
            "--model",
            str(tiny_dir),
            "--json",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "hi",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    record = json.loads(out.stdout)
    assert len(record["token_ids"]) == 3
