"""Derived profiles: devices' and models' figures, the roofline's arithmetic on a toy worker
worked by hand, its parsing errors, and the ``derived`` field of a Profile."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.coordinator.profile import Profile
from pdserve.sim.derive import Efficiency, Roofline, derive_profile
from pdserve.sim.devices import DEVICES, Device, device, parse_device
from pdserve.sim.shapes import SHAPES, ModelShape, parse_shape, shape, shape_from_config

# A toy worker small enough to work by hand.
#   a layer: q, k, v 8·(2+2)·4 = 128, o 2·4·8 = 64, MLP 3·8·16 = 384, norms 16 → 592
#   params: embeddings 256 + 2·592 + final norm 8 + lm head 256 = 1704 (3408 bytes)
#   matmul params (all but the embedding lookup): 1448, a step reads 2896 bytes
#   KV a token: 2 (K, V) · 2 layers · 1 head · 4 · 2 bytes = 32
TOY = ModelShape(
    name="toy",
    layers=2,
    hidden=8,
    heads=2,
    kv_heads=1,
    head_dim=4,
    intermediate=16,
    vocab=32,
)
TOY_DEVICE = Device(
    "toy",
    flops=1e5,
    mem_bw=1e4,
    mem_bytes=1e5,
    link_bw=1e3,
    net_bw=1e3,
    link_latency_s=1e-3,
)
TOY_EFFICIENCY = Efficiency(
    prefill_mfu=0.5,
    decode_mbu=0.5,
    decode_mfu=0.25,
    step_overhead_s=0.01,
    allreduce_efficiency=0.5,
    memory_utilization=0.5,
    activation_reserve_bytes=1000,
)


def _toy(tp: int = 1, **changes: Any) -> Roofline:
    return Roofline(TOY, dataclasses.replace(TOY_DEVICE, **changes), tp, TOY_EFFICIENCY)


def test_the_toy_shapes_counts() -> None:
    assert (TOY.layer_params(), TOY.params(), TOY.matmul_params()) == (592, 1704, 1448)
    assert (TOY.weight_bytes(), TOY.kv_bytes_per_token()) == (3408, 32)
    assert TOY.flops_per_token(10) == 2 * 1448 + 4 * 2 * 2 * 4 * 10  # 3536
    assert TOY.prefill_flops(128) == 2 * 1448 * 128 + 2 * 2 * 2 * 4 * 128 * 128  # 894976
    tied = dataclasses.replace(TOY, tied_embeddings=True)
    assert (tied.params(), tied.matmul_params()) == (1704 - 256, 1448)


def test_derive_the_toy_by_hand() -> None:
    profile = derive_profile(
        TOY,
        TOY_DEVICE,
        block_size=4,
        efficiency=TOY_EFFICIENCY,
        max_prompt=256,
        batches=(1, 2, 512),
        contexts=(10, 100),
    )
    # (1e5 · 0.5 usable − 3408 weights − 1000 reserved) / (4 tokens · 32 bytes) = 356.19
    assert profile.kv_blocks == 356
    # 894976 FLOPs / (1e5 · 0.5) = 17.89952 (the 2896 bytes read take 0.5792), + 0.01
    # 256 tokens: (2·1448·256 + 32·256²) = 2838528 FLOPs / 5e4 = 56.77056, + 0.01
    assert profile.prefill == ((128, 17.9095), (256, 56.7806))
    # memory-bound: (2896 + b·c·32 bytes) / (1e4 · 0.5) + 0.01; batch 512 needs 512 · 3
    # blocks at context 10 (1536 > 356): left out
    assert profile.decode == (
        (1, 10, 0.6532),  # 3216 bytes
        (2, 10, 0.7172),  # 3536 bytes
        (1, 100, 1.2292),  # 6096 bytes
        (2, 100, 1.8692),  # 9296 bytes
    )
    assert (profile.model, profile.device, profile.threads, profile.block_size) == (
        "toy",
        "toy",
        1,
        4,
    )
    assert profile.tensor_parallel_size == 1 and profile.is_derived


def test_a_big_decode_batch_is_compute_bound() -> None:
    # 512 · 3536 FLOPs / (1e5 · 0.25) = 72.41728 > (2896 + 512·320 bytes) / 5e3 = 33.3472
    assert _toy().decode_step_seconds(512, 10) == pytest.approx(72.41728 + 0.01)


def test_the_toy_split_over_two_ranks() -> None:
    roof = _toy(tp=2)
    # the one KV head is replicated, not halved; the weights are halved
    assert (roof.kv_bytes_per_token(), roof.weight_bytes(), roof.streamed_weight_bytes()) == (
        32,
        1704,
        1448,
    )
    assert roof.kv_blocks(4) == 369  # (50000 − 1704 − 1000) / 128 = 369.5
    # 2 all-reduces a layer of 2 tokens · 8 · 2 bytes = 32 bytes, each
    # 2 · 1e-3 + 2 · 1/2 · 32 / (1e3 · 0.5) = 0.066
    assert roof.allreduce_seconds(2) == pytest.approx(4 * 0.066)
    # (1448 + 640 bytes) / 5e3 = 0.4176 beats 3536 FLOPs / 2.5e4 = 0.14144
    assert roof.decode_step_seconds(2, 10) == pytest.approx(0.4176 + 0.264 + 0.01)
    assert _toy().allreduce_seconds(2) == 0.0


def test_fewer_than_three_fitting_points_keep_the_three_needing_least() -> None:
    # (10016 · 0.5 − 3408 − 1000) / 128 = 4.69 blocks: only batch 1 at context 10 fits
    tight = dataclasses.replace(TOY_DEVICE, mem_bytes=10016)
    profile = derive_profile(
        TOY,
        tight,
        block_size=4,
        efficiency=TOY_EFFICIENCY,
        max_prompt=1000,
        batches=(1, 2, 512),
        contexts=(10, 100),
    )
    assert profile.kv_blocks == 4
    assert [(b, c) for b, c, _ in profile.decode] == [(1, 10), (2, 10), (1, 100)]
    assert [n for n, _ in profile.prefill] == [128, 256, 512, 1000]


def test_the_catalog_shapes_parameter_counts() -> None:
    known = {
        "llama-3-8b": 8.03e9,
        "llama-3-70b": 70.6e9,
        "llama-3.1-405b": 405.9e9,
        "qwen2.5-7b": 7.62e9,
        "smollm2-135m": 134.5e6,
    }
    assert set(SHAPES) == set(known)
    for name, params in known.items():
        assert shape(name).params() == pytest.approx(params, rel=0.01), name
    assert shape("llama-3-70b").kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2  # 320 KiB
    assert shape("smollm2-135m").weight_bytes() == 134_515_008 * 4


def test_tensor_parallel_halves_the_weights_each_rank_reads() -> None:
    s, d = shape("llama-3-70b"), device("h100")
    quiet = Efficiency(step_overhead_s=0.0)
    two, four = Roofline(s, d, 2, quiet), Roofline(s, d, 4, quiet)
    # batch 1, context 0: only the weights are read
    t2 = two.decode_step_seconds(1, 0) - two.allreduce_seconds(1)
    t4 = four.decode_step_seconds(1, 0) - four.allreduce_seconds(1)
    assert t2 == pytest.approx(s.matmul_params() * 2 / 2 / (3.35e12 * 0.7))
    assert t4 == pytest.approx(t2 / 2)


def test_kv_heads_are_replicated_past_kv_heads_ranks() -> None:
    s, wide = shape("llama-3-8b"), parse_device("h100,devices_per_node=16")
    per_rank = [Roofline(s, wide, tp).kv_bytes_per_token() for tp in (1, 2, 8, 16)]
    assert per_rank == [131072, 65536, 16384, 16384]  # 8 KV heads: one a rank past 8


def test_the_sanity_figures() -> None:
    p70 = derive_profile(shape("llama-3-70b"), device("h100"), tp=8)
    # (80e9 · 0.9 − 70.55e9 · 2 / 8 − 4e9) / (16 · 2 · 80 · 1 · 128 · 2) = 76845.6
    assert p70.kv_blocks == 76845
    assert p70.tensor_parallel_size == 8 and p70.device == "h100"
    assert len(p70.prefill) == 9 and p70.prefill[-1][0] == 32768
    assert "roofline: h100 x8 (989 TFLOP/s, 3.35 TB/s, 80 GB" in p70.derived
    for factor in (
        "prefill MFU 0.5",
        "decode MBU 0.7",
        "decode MFU 0.5",
        "step overhead 2 ms",
        "all-reduce efficiency 0.7",
        "memory utilization 0.9",
        "activation reserve 4 GB",
        "llama-3-70b (80 layers",
    ):
        assert factor in p70.derived
    # the grid's corners that do not fit are left out: 512 · 1024 blocks > 76845
    assert (512, 16384) not in {(b, c) for b, c, _ in p70.decode}
    assert (64, 16384) in {(b, c) for b, c, _ in p70.decode}


def test_a_model_too_big_for_its_devices() -> None:
    with pytest.raises(ValueError, match=r"llama-3.1-405b does not fit on 8 x h100: .* 101 GB"):
        derive_profile(shape("llama-3.1-405b"), device("h100"), tp=8)
    with pytest.raises(ValueError, match=r"tensor parallel size 16 .* spans one node"):
        Roofline(shape("llama-3-8b"), device("h100"), 16)
    with pytest.raises(ValueError, match=r"derive max_prompt: 128 is not an integer"):
        derive_profile(shape("llama-3-8b"), device("h100"), max_prompt=128)
    with pytest.raises(ValueError, match=r"derive batches: one or more distinct"):
        derive_profile(shape("llama-3-8b"), device("h100"), batches=(1, 1))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prefill_mfu": 0.0}, r"prefill_mfu: 0.0 is not a number in \(0, 1\]"),
        ({"decode_mbu": 1.5}, "decode_mbu: 1.5"),
        ({"step_overhead_s": -1.0}, r"step_overhead_s: -1.0 is not a number in \[0, 1\]"),
        ({"memory_utilization": float("nan")}, "memory_utilization: nan"),
        ({"activation_reserve_bytes": True}, "activation_reserve_bytes: True"),
    ],
)
def test_bad_efficiencies(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Efficiency(**changes)


# ---- devices ---------------------------------------------------------------------------------


def test_devices() -> None:
    assert list(DEVICES) == ["h100", "h200", "a100", "l40s", "b200"]
    assert (device("h200").mem_bw, device("h200").mem_bytes) == (4.8e12, 141e9)
    with pytest.raises(ValueError, match="unknown device 'h300': known devices are h100, h200"):
        device("h300")
    faster = parse_device("h100, mem_bw=4e12, name=h100x")
    assert faster == dataclasses.replace(device("h100"), mem_bw=4e12, name="h100x")
    spec = "name=mine,flops=1e15,mem_bw=2e12,mem_bytes=96e9,link_bw=1e11,net_bw=2.5e10"
    mine = parse_device(spec + ",devices_per_node=4")
    assert (mine.flops, mine.devices_per_node, mine.link_latency_s) == (1e15, 4, 5e-6)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("h100,flops=-1", r"device flops: -1.0 is not a number in \(0, 1e\+18\]"),
        ("h100,mem_bw=fast", "device mem_bw: 'fast' is not a number"),
        ("h100,mem_bw=inf", "device mem_bw: inf"),
        ("h100,devices_per_node=0", "device devices_per_node: 0 is not an integer"),
        ("h100,colour=green", "'colour=green' is not <field>=<value>"),
        ("h100,flops=1e15,flops=2e15", "flops given twice"),
        ("h100,name=H100", "device name: 'H100' is not"),
        ("name=x,flops=1e15", "missing mem_bw, mem_bytes, link_bw, net_bw"),
        ("z100", "unknown device 'z100'"),
    ],
)
def test_bad_device_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_device(spec)


# ---- shapes ----------------------------------------------------------------------------------

SPEC_70B = "layers=80,hidden=8192,heads=64,kv_heads=8,intermediate=28672,vocab=128256"


def test_parse_shape() -> None:
    assert parse_shape(SPEC_70B + ",name=llama-3-70b") == shape("llama-3-70b")
    int4 = parse_shape(SPEC_70B + ",dtype=int4,tied=true,head_dim=256")
    assert (int4.weight_bytes_per_param, int4.kv_bytes_per_element) == (0.53125, 2.0)
    assert (int4.head_dim, int4.tied_embeddings, int4.name) == (256, True, "custom")
    fp8 = parse_shape(SPEC_70B + ",dtype=bf16,kv_dtype=fp8")
    assert (fp8.weight_bytes_per_param, fp8.kv_bytes_per_element) == (2.0, 1.0)
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'"):
        shape("gpt-5")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SPEC_70B.replace(",vocab=128256", ""), "shape spec vocab: missing"),
        (SPEC_70B.replace("hidden=8192", "hidden=abc"), "hidden: 'abc' is not a positive"),
        (SPEC_70B.replace("layers=80", "layers=0"), "layers: '0' is not a positive integer"),
        (SPEC_70B.replace("layers=80", "layers=-3"), "layers: '-3' is not a positive"),
        (SPEC_70B.replace("layers=80", "layers=5000"), r"shape layers: 5000 is not .*4096\]"),
        (SPEC_70B.replace("kv_heads=8", "kv_heads=7"), r"kv_heads: 7 does not divide heads"),
        (SPEC_70B.replace("heads=64", "heads=63"), "head_dim: missing, and heads"),
        (SPEC_70B + ",dtype=fp4", "dtype: 'fp4' is not one of"),
        (SPEC_70B + ",kv_dtype=int4", "kv_dtype: 'int4' is not one of"),
        (SPEC_70B + ",tied=yes", "tied: 'yes' is not true or false"),
        (SPEC_70B + ",name=../x", "shape name"),
        (SPEC_70B + ",layers=81", "layers given twice"),
        (SPEC_70B + ",experts=8", "'experts=8' is not <field>=<value>"),
    ],
)
def test_bad_shape_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_shape(spec)


LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _config(tmp_path: Path, **changes: Any) -> Path:
    directory = tmp_path / "Llama-3-8B"
    directory.mkdir(exist_ok=True)
    config = {**LLAMA_8B_CONFIG, **changes}
    (directory / "config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v != "<drop>"})
    )
    return directory


def test_shape_from_config(tmp_path: Path) -> None:
    directory = _config(tmp_path)
    assert shape_from_config(directory) == shape("llama-3-8b")  # named after its directory
    assert shape_from_config(directory / "config.json", name="x").name == "x"
    fp32 = shape_from_config(_config(tmp_path, torch_dtype="<drop>", dtype="float32"))
    assert (fp32.weight_bytes_per_param, fp32.kv_bytes_per_element) == (4.0, 4.0)
    # Hugging Face's defaults: bf16 without a dtype, MHA without num_key_value_heads
    mha = shape_from_config(_config(tmp_path, torch_dtype="<drop>", num_key_value_heads="<drop>"))
    assert (mha.kv_heads, mha.head_dim, mha.weight_bytes_per_param) == (32, 128, 2.0)
    quantized = _config(tmp_path, quantization_config={"bits": 4})
    assert shape_from_config(quantized, dtype="int4").weight_bytes_per_param == 0.53125


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": "<drop>"}, "config.json num_hidden_layers: missing"),
        ({"hidden_size": "4096"}, "config.json hidden_size: '4096' is not a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads: 0 is not a positive integer"),
        ({"vocab_size": True}, "vocab_size: True is not a positive integer"),
        ({"intermediate_size": 2.5}, "intermediate_size: 2.5 is not a positive"),
        ({"head_dim": -1}, "head_dim: -1 is not a positive integer"),
        ({"num_key_value_heads": 5}, "kv_heads: 5 does not divide heads"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings: 'no' is not true or false"),
        ({"torch_dtype": "float8"}, "torch_dtype: 'float8' is not one of"),
        ({"torch_dtype": ["x"]}, r"torch_dtype: \['x'\] is not one of"),
        ({"quantization_config": {"bits": 4}}, "quantization_config: a quantized model"),
    ],
)
def test_bad_configs(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        shape_from_config(_config(tmp_path, **changes))


def test_unreadable_configs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json: No such file"):
        shape_from_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"config\.json: not a JSON object"):
        shape_from_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ValueError, match=r"config\.json: not JSON"):
        shape_from_config(tmp_path)


# ---- the Profile's derived field -------------------------------------------------------------


def _toy_profile() -> Profile:
    return derive_profile(
        TOY, TOY_DEVICE, block_size=4, efficiency=TOY_EFFICIENCY, max_prompt=256, contexts=(10,)
    )


def test_derived_round_trips_and_measured_files_stay_as_they_were(tmp_path: Path) -> None:
    derived = _toy_profile()
    path = tmp_path / "derived.json"
    derived.save(path)
    assert path.read_text().splitlines()[4].startswith(' "derived": "roofline: toy x1 (')
    back = Profile.load(path)
    assert back == derived and back.is_derived and back.derived.startswith("roofline: toy x1")
    measured = dataclasses.replace(derived, derived="")
    assert "derived" not in measured.to_json() and not measured.is_derived
    # a file written before the field: measured
    old = {k: v for k, v in derived.to_json().items() if k != "derived"}
    assert Profile.from_json(old) == measured


@pytest.mark.parametrize(
    ("derived", "message"),
    [
        ("two\nlines", "profile derived: one printable line of at most 1000"),
        ("x" * 1001, "profile derived: one printable line"),
        (3, "profile derived: one printable line"),
    ],
)
def test_bad_derived_fields(derived: Any, message: str) -> None:
    data = {**_toy_profile().to_json(), "derived": derived}
    with pytest.raises(ValueError, match=message):
        Profile.from_json(data)


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "h100", "l40s", "b200:7"])
def test_profile_device_names_accepted(name: str) -> None:
    assert dataclasses.replace(_toy_profile(), device=name).device == name


@pytest.mark.parametrize("name", ["H100", "100h", "h100:1234", "cuda; rm", "", "a" * 17])
def test_profile_device_names_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a valid device"):
        dataclasses.replace(_toy_profile(), device=name)
