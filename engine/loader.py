"""Load a local Hugging Face checkpoint directory into a ``CausalLM``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.model import CausalLM
from pdserve.engine.rope import RotaryEmbedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def resolve_dtype(requested: str, cfg: ModelConfig) -> torch.dtype:
    name = cfg.torch_dtype if requested == "auto" else requested
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: sharded through model.safetensors.index.json, else *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(
                f"{index} names shard(s) missing from {path}: {', '.join(missing)}"
            )
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model directory {path} has no *.safetensors weights")
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(
    path: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> CausalLM:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    cfg = ModelConfig.from_dir(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    files = safetensors_files(path)
    positions = max_positions or cfg.max_position_embeddings
    # parameters start on meta (no random init), then get real, uninitialised storage
    with torch.device("meta"):
        model = CausalLM(cfg, positions)
    model = model.to_empty(device=device).to(dtype=torch_dtype)
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, positions).to(device)  # float32
    try:
        model.load_weights(iter_weights(files))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return model.eval()
