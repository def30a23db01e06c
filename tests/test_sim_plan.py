"""``pdserve plan`` and the layout search behind it (sim/search.py, launch/plan.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.launch.cli import main
from pdserve.sim.search import fewest

PROFILE = "models/profiles/smollm2-135m-instruct.json"
SMALL = [
    "--workload",
    "rate=1,duration=40,prompt=128,output=64",
    "--ttft-slo",
    "5",
    "--tpot-slo",
    "150ms",
]


def test_fewest_finds_the_threshold_from_below_and_above() -> None:
    for threshold in (1, 2, 7, 30, 100):
        for start in (1, 5, 50, 200):
            asked: list[int] = []

            def meets(n: int, t: int = threshold, asked: list[int] = asked) -> bool:
                asked.append(n)
                return n >= t

            assert fewest(meets, start, 200) == threshold
            assert len(asked) <= 30
    assert fewest(lambda n: False, 3, 10) is None


def test_plan_on_the_shipped_profile_prints_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--model",
        "smollm2-135m-instruct",
        "--profile",
        PROFILE,
        "--shape",
        "smollm2-135m",
        *SMALL,
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "measured, TP 1" in out and "DERIVED" not in out
    assert "disagg 1P x TP1 + 1D x TP1" in out
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not doc["derived"]
    layouts = doc["layouts"]
    assert layouts and all(v["meets_slo"] for v in layouts)
    assert [v["devices"] for v in layouts] == sorted(v["devices"] for v in layouts)
    first = layouts[0]
    assert first["p99_ttft_ms"] <= 5000 and first["p99_tpot_ms"] <= 150
    assert first["binding"].startswith(("TTFT p99", "TPOT p99"))


def test_plan_on_a_derived_profile_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--model",
        "llama-3-8b",
        "--device",
        "h100",
        "--tp",
        "1,2",
        "--workload",
        "rate=20,duration=20,prompt=1000,output=200",
        "--ttft-slo",
        "0.5",
        "--tpot-slo",
        "0.05",
        "--price-per-device-hour",
        "2",
        "--json",
    ]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["derived"] and doc["profiles"][0].startswith("profiles DERIVED, not measured")
    best = doc["layouts"][0]
    assert best["cost_per_million_output_tokens"] > 0
    # the cost is the devices' price over the tokens served
    tokens = best["goodput_req_s"] * 200
    assert best["cost_per_million_output_tokens"] == pytest.approx(
        2 * best["devices"] / 3600 / tokens * 1e6
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ttft-slo", "0"], "--ttft-slo must be > 0"),
        (["--tpot-slo", "-1ms"], "--tpot-slo must be > 0"),
        (["--workload", "rate=1,duration=5,prompt=-3,output=4"], "workload.prompt"),
        (["--device", "h900"], "unknown device 'h900'"),
        (["--modes", "split"], "--modes"),
    ],
)
def test_plan_bad_input_names_the_field(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {
        "--model": "llama-3-8b",
        "--device": "h100",
        "--workload": "rate=1,duration=5,prompt=100,output=10",
        "--ttft-slo": "1",
        "--tpot-slo": "0.1",
    }
    base.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    args = ["plan", *[f"{k}={v}" for k, v in base.items()]]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_plan_workload_file_with_a_negative_length(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "w.json"
    path.write_text(
        json.dumps(
            {
                "rate": 1,
                "duration_s": 5,
                "prompt": 100,
                "output": {"dist": "uniform", "low": -4, "high": 8},
            }
        )
    )
    args = [
        "plan",
        "--model",
        "llama-3-8b",
        "--device",
        "h100",
        "--workload",
        str(path),
        "--ttft-slo",
        "1",
        "--tpot-slo",
        "0.1",
    ]
    assert main(args) == 2
    assert "output" in capsys.readouterr().err
