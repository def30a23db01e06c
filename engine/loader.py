"""Load a local model directory into a ``CausalLM``, in the weight form asked for.

quantization  directory with model.gguf (pulled)          float-only directory
auto          GGUF-kept: its Q8_0/Q4_0/Q4_1 blocks served   float
              as QuantLinear layers (quant/gguf_model.py)
none          float: model.safetensors, else the GGUF       float
              dequantized
int8 / int4   float, then quantized at load (engine/quant/apply.py)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pdserve.engine.config import ModelConfig
from pdserve.engine.meta_init import on_meta
from pdserve.engine.model import CausalLM
from pdserve.engine.rope import RotaryEmbedding
from pdserve.models.gguf import GGUFFile
from pdserve.models.gguf_convert import iter_hf_tensors
from pdserve.models.store import GGUF_FILE

if TYPE_CHECKING:
    from pdserve.engine.tp.layout import TPLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", "int8", "int4")


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


def iter_weights(
    files: list[Path], layout: TPLayout | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``files``; with ``layout``, only a tensor-parallel rank's part of each,
    read from the file as that part alone."""
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                part = None if layout is None else layout.slice_of(name)
                if part is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, stop = part
                view = f.get_slice(name)
                yield name, view[start:stop] if dim == 0 else view[:, start:stop]


def sliced(
    weights: Iterator[tuple[str, torch.Tensor]], layout: TPLayout | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` cut to a tensor-parallel rank's parts (for sources read whole)."""
    for name, tensor in weights:
        part = None if layout is None else layout.slice_of(name)
        yield name, tensor if part is None else tensor.narrow(part[0], part[1], part[2] - part[1])


def load_model(
    path: str | Path,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    quantization: str = "auto",
    group_size: int = 32,
    layout: TPLayout | None = None,
) -> CausalLM:
    """``path``'s model with its weights in the form ``quantization`` names (module docstring);
    ``group_size``: int4's weights per scale; ``layout``: a tensor-parallel rank's part of it
    (engine/tp/layout.py), its modules sized to it."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    cfg = ModelConfig.from_dir(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    positions = max_positions or cfg.max_position_embeddings
    gguf = path / GGUF_FILE
    if quantization == "auto" and gguf.is_file():
        from pdserve.engine.quant.gguf_model import load_gguf_kept

        try:
            kept = load_gguf_kept(gguf, cfg, positions, torch_dtype, device, layout)
        except ValueError as e:
            raise ModelLoadError(f"{gguf}: {e}") from e
        if kept is not None:  # None: every tensor in it is float
            return _finish_rank(kept, layout).eval()
    model = empty_model(cfg, positions, torch_dtype, device, layout)
    try:
        if gguf.is_file() and not _has_safetensors(path):
            with GGUFFile(gguf, strings=False) as f:
                floats = iter_hf_tensors(f, cfg.num_heads, cfg.num_kv_heads)
                model.load_weights(sliced(floats, layout))
        else:
            model.load_weights(iter_weights(safetensors_files(path), layout))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    _finish_rank(model, layout)
    if quantization in ("int8", "int4"):
        from pdserve.engine.quant.apply import quantize_model

        quantize_model(model, quantization, group_size)
    return model.eval()


def empty_model(
    cfg: ModelConfig,
    positions: int,
    dtype: torch.dtype,
    device: str | torch.device,
    layout: TPLayout | None = None,
) -> CausalLM:
    """A ``CausalLM`` with real, uninitialised storage (its parameters start on meta: no
    random init), the rotary table in float32; a tensor-parallel rank's part with ``layout``."""
    with on_meta():
        model = rank_model(cfg, positions, layout)
    return materialise(model, cfg, positions, dtype, device)


def rank_model(cfg: ModelConfig, positions: int, layout: TPLayout | None) -> CausalLM:
    """The modules of the whole model, or of a tensor-parallel rank's part of it."""
    if layout is None:
        return CausalLM(cfg, positions)
    return CausalLM(layout.local_config(), positions, layout.vocab)


def _finish_rank(model: CausalLM, layout: TPLayout | None) -> CausalLM:
    """A row-split layer's bias is added once, by rank 0: the others' is zero."""
    if layout is not None and layout.rank > 0:
        for layer in model.decoder_layers():
            bias = getattr(layer.self_attn.o_proj, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.data.zero_()
    return model


def materialise(
    model: CausalLM,
    cfg: ModelConfig,
    positions: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> CausalLM:
    """``model``'s meta parameters given real, uninitialised storage in ``dtype``."""
    model = model.to_empty(device=device).to(dtype=dtype)
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, positions).to(device)  # float32
    return model


def _has_safetensors(path: Path) -> bool:
    return (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))
