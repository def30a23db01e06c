"""``pdserve bench`` against the project's own cluster (``pdserve serve``, tiny model)."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.metrics import METRICS
from pdserve.launch.cli import main
from tests.e2e_util import ServedCluster

VLLM_KEYS = {
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "start_times",
    "generated_texts",
    "errors",
} | {
    f"{s}_{m}_ms" for s in ("mean", "median", "std", "p99") for m in ("ttft", "tpot", "itl", "e2el")
}


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    c = ServedCluster(tiny_dir, "--num-kv-blocks=256")
    yield c
    c.stop()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_against_gateway(cluster, tiny_dir, tmp_path, endpoint) -> None:
    out = tmp_path / "r.json"
    argv = [
        "bench",
        f"--base-url={cluster.url}",
        f"--endpoint={endpoint}",
        f"--tokenizer={tiny_dir}",
        "--num-prompts=12",
        "--random-input-len=48",
        "--random-output-len=20",
        "--request-rate=40",
        "--max-concurrency=6",
        "--ignore-eos",
        "--warmup=2",
        "--slo",
        "ttft:60000",
        f"--save-result={out}",
        "--save-detailed",
        "--no-progress",
    ]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert set(r) >= VLLM_KEYS | {f"p90_{m}_ms" for m in METRICS}
    assert (r["completed"], r["failed"], r["model_id"]) == (12, 0, cluster.model_name)
    # ignore_eos: every stream is exactly as long as asked, by the server's usage
    assert r["output_lens"] == [20] * 12 and r["total_output_tokens"] == 240
    assert all(len(itl) >= 1 for itl in r["itls"])
    if endpoint == "/v1/completions":  # token-level prompts: 48 tokens, plus the bos
        assert r["input_lens"] == [49] * 12
    else:  # the chat template wraps them
        assert min(r["input_lens"]) > 48
    assert r["slo_attainment"] == 1.0 and r["request_goodput"] == r["request_throughput"]
    assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] <= r["max_ttft_ms"]
    assert 0 < r["median_tpot_ms"] < r["median_e2el_ms"]
    used = cluster.wait_blocks_free()
    assert used and not any(used.values())
