"""Models' shapes: the counts a roofline profile (sim/derive.py) is computed from.

A Llama-style decoder (Llama 3, Qwen 2.5, SmolLM2): grouped-query attention, a SwiGLU MLP of
three matrices, RMSNorms; biases (Qwen's q/k/v, a few thousand parameters a layer) are left
out. A shape comes from the catalog (``shape``), a spec (``parse_shape``) or a Hugging Face
``config.json`` (``shape_from_config``).

    per layer   q [hidden, heads·head_dim]   k, v [hidden, kv_heads·head_dim]
                o [heads·head_dim, hidden]   gate, up [hidden, intermediate]
                down [intermediate, hidden]  2 norms [hidden]
    once        embeddings [vocab, hidden]   final norm [hidden]
                lm head [hidden, vocab] (the embeddings again when tied)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.coordinator.profile import read_bounded

# bytes a weight: int4 is 4 bits plus, per group of 128 weights, a 16-bit scale and zero point
WEIGHT_DTYPES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.53125}
KV_DTYPES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0}
_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # a Profile's model name
_INT = re.compile(r"[0-9]{1,12}")
MAX_CONFIG_BYTES = 1 << 20
# field -> highest value accepted (each at least 1)
_BOUNDS = {
    "layers": 4096,
    "hidden": 1 << 20,
    "heads": 1 << 14,
    "kv_heads": 1 << 14,
    "head_dim": 1 << 14,
    "intermediate": 1 << 22,
    "vocab": 1 << 24,
}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes and the bytes its weights and KV cache take an element."""

    name: str  # the model's served name (a Profile's ``model``)
    layers: int
    hidden: int
    heads: int
    kv_heads: int  # grouped-query attention: heads share each KV head, heads % kv_heads == 0
    head_dim: int
    intermediate: int
    vocab: int
    weight_bytes_per_param: float = 2.0  # WEIGHT_DTYPES
    kv_bytes_per_element: float = 2.0  # KV_DTYPES
    tied_embeddings: bool = False  # the lm head is the embedding matrix

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"shape name: {str(self.name)[:40]!r} is not a valid model name")
        for field, high in _BOUNDS.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise ValueError(f"shape {field}: {value!r} is not an integer in [1, {high}]")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"shape kv_heads: {self.kv_heads} does not divide heads ({self.heads})"
            )
        for field in ("weight_bytes_per_param", "kv_bytes_per_element"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 8:
                raise ValueError(f"shape {field}: {value!r} is not a number in (0, 8]")
        if not isinstance(self.tied_embeddings, bool):
            raise ValueError(f"shape tied_embeddings: {self.tied_embeddings!r} is not a bool")

    def layer_params(self) -> int:
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        attention += self.heads * self.head_dim * self.hidden
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def params(self) -> int:
        """Every parameter: embeddings, layers, final norm, the lm head unless tied."""
        embeddings = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else embeddings
        return embeddings + self.layers * self.layer_params() + self.hidden + head

    def matmul_params(self) -> int:
        """The parameters a token is multiplied by (and a step reads whole): all but the
        embedding lookup, a row a token (when tied the matrix is read as the lm head)."""
        return self.layers * self.layer_params() + self.hidden + self.vocab * self.hidden

    def weight_bytes(self) -> float:
        return self.params() * self.weight_bytes_per_param

    def kv_bytes_per_token(self) -> float:
        """K and V of one token across the layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_element

    def flops_per_token(self, context: int) -> int:
        """A decoded token's FLOPs: 2 a matmul parameter, and attention over ``context``
        tokens (scores and the weighted sum: 2 matmuls of heads·head_dim a context token)."""
        return 2 * self.matmul_params() + 4 * self.layers * self.heads * self.head_dim * context

    def prefill_flops(self, tokens: int) -> int:
        """FLOPs of prefilling ``tokens``: causal attention sees half the n² pairs."""
        attention = 2 * self.layers * self.heads * self.head_dim * tokens * tokens
        return 2 * self.matmul_params() * tokens + attention

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation element: fp32 models compute in fp32, the rest in 16 bits
        (quantized weights too: they are dequantized into bf16 matmuls)."""
        return 4 if self.weight_bytes_per_param >= 4 else 2


def _llama(name: str, layers: int, hidden: int, heads: int, intermediate: int) -> ModelShape:
    return ModelShape(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=8,
        head_dim=128,
        intermediate=intermediate,
        vocab=128256,
    )


# Source: each model's config.json on the Hugging Face Hub.
SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _llama("llama-3-8b", layers=32, hidden=4096, heads=32, intermediate=14336),
        _llama("llama-3-70b", layers=80, hidden=8192, heads=64, intermediate=28672),
        _llama("llama-3.1-405b", layers=126, hidden=16384, heads=128, intermediate=53248),
        ModelShape(
            name="qwen2.5-7b",
            layers=28,
            hidden=3584,
            heads=28,
            kv_heads=4,
            head_dim=128,
            intermediate=18944,
            vocab=152064,
        ),
        # what runs on this CPU machine: float32 weights and KV
        ModelShape(
            name="smollm2-135m",
            layers=30,
            hidden=576,
            heads=9,
            kv_heads=3,
            head_dim=64,
            intermediate=1536,
            vocab=49152,
            weight_bytes_per_param=4.0,
            kv_bytes_per_element=4.0,
            tied_embeddings=True,
        ),
    )
}


def shape(name: str) -> ModelShape:
    """The catalog's shape ``name``; ``ValueError`` naming the known ones otherwise."""
    found = SHAPES.get(name)
    if found is None:
        raise ValueError(f"unknown model shape {name[:40]!r}: known shapes are {', '.join(SHAPES)}")
    return found


def parse_shape(spec: str) -> ModelShape:
    """A shape from ``"layers=80,hidden=8192,heads=64,kv_heads=8,intermediate=28672,
    vocab=128256"`` and optionally ``head_dim`` (default hidden/heads), ``dtype`` (bf16),
    ``kv_dtype`` (the weights' dtype, bf16 for int4), ``tied`` (true/false), ``name``."""
    given: dict[str, str] = {}
    known = {*_BOUNDS, "dtype", "kv_dtype", "tied", "name"}
    for part in spec.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or key not in known:
            raise ValueError(
                f"shape spec: {part[:40]!r} is not <field>=<value> with a field among "
                f"{', '.join(sorted(known))}"
            )
        if key in given:
            raise ValueError(f"shape spec: {key} given twice")
        given[key] = value
    ints = {k: _int(k, given.get(k), "shape spec") for k in _BOUNDS if k != "head_dim"}
    if "head_dim" in given:
        head_dim = _int("head_dim", given["head_dim"], "shape spec")
    else:
        head_dim = _head_dim(ints["hidden"], ints["heads"], "shape spec")
    tied = given.get("tied", "false")
    if tied not in ("true", "false"):
        raise ValueError(f"shape spec tied: {tied[:40]!r} is not true or false")
    dtype, kv_dtype = _dtypes(given.get("dtype", "bf16"), given.get("kv_dtype"), "shape spec")
    return ModelShape(
        name=given.get("name", "custom"),
        head_dim=head_dim,
        weight_bytes_per_param=WEIGHT_DTYPES[dtype],
        kv_bytes_per_element=KV_DTYPES[kv_dtype],
        tied_embeddings=tied == "true",
        **ints,
    )


def shape_from_config(
    path: str | Path, name: str | None = None, dtype: str | None = None, kv_dtype: str | None = None
) -> ModelShape:
    """A shape from a Hugging Face ``config.json`` (the file or its model directory), named
    after the directory unless ``name``; ``dtype`` defaults to the config's ``torch_dtype``
    (bf16 if it has none) and must be given for a quantized model (``quantization_config``)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    where = str(file)
    try:
        raw = read_bounded(file, MAX_CONFIG_BYTES)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError, ValueError) as e:
        raise ValueError(f"{where}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: not a JSON object")
    ints = {
        "layers": _config_int(config, "num_hidden_layers", where),
        "hidden": _config_int(config, "hidden_size", where),
        "heads": _config_int(config, "num_attention_heads", where),
        "intermediate": _config_int(config, "intermediate_size", where),
        "vocab": _config_int(config, "vocab_size", where),
    }
    # Hugging Face's own defaults: as many KV heads as heads, hidden/heads a head
    kv = config.get("num_key_value_heads")
    ints["kv_heads"] = (
        ints["heads"] if kv is None else _config_int(config, "num_key_value_heads", where)
    )
    if config.get("head_dim") is None:
        ints["head_dim"] = _head_dim(ints["hidden"], ints["heads"], where)
    else:
        ints["head_dim"] = _config_int(config, "head_dim", where)
    tied = config.get("tie_word_embeddings", False)  # LlamaConfig's default
    if not isinstance(tied, bool):
        raise ValueError(f"{where} tie_word_embeddings: {tied!r} is not true or false")
    if dtype is None:
        if "quantization_config" in config:
            raise ValueError(f"{where} quantization_config: a quantized model: give its dtype")
        dtype = _config_dtype(config, where)
    dtype, kv_dtype = _dtypes(dtype, kv_dtype, where)
    if name is None:
        name = file.resolve().parent.name.lower()
    return ModelShape(
        name=name,
        weight_bytes_per_param=WEIGHT_DTYPES[dtype],
        kv_bytes_per_element=KV_DTYPES[kv_dtype],
        tied_embeddings=tied,
        **ints,
    )


# ---- parsing helpers -------------------------------------------------------------------------


def _int(field: str, text: str | None, where: str) -> int:
    if text is None:
        raise ValueError(f"{where} {field}: missing")
    if not _INT.fullmatch(text) or int(text) < 1:
        raise ValueError(f"{where} {field}: {text[:40]!r} is not a positive integer")
    return int(text)


def _config_int(config: dict[str, Any], key: str, where: str) -> int:
    if key not in config:
        raise ValueError(f"{where} {key}: missing")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} {key}: {repr(value)[:40]} is not a positive integer")
    return value


def _head_dim(hidden: int, heads: int, where: str) -> int:
    if hidden % heads:
        raise ValueError(f"{where} head_dim: missing, and heads ({heads}) do not divide {hidden}")
    return hidden // heads


def _config_dtype(config: dict[str, Any], where: str) -> str:
    key = "torch_dtype" if "torch_dtype" in config else "dtype"  # newer files say "dtype"
    value = config.get(key, "bfloat16")
    if not isinstance(value, str) or value not in _TORCH_DTYPES:
        raise ValueError(
            f"{where} {key}: {repr(value)[:40]} is not one of {', '.join(_TORCH_DTYPES)}"
        )
    return _TORCH_DTYPES[value]


def _dtypes(dtype: str, kv_dtype: str | None, where: str) -> tuple[str, str]:
    """The weights' and the KV cache's dtypes; the KV's defaults to the weights' (bf16 under
    int4, which no KV cache here is kept in)."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{where} dtype: {dtype[:40]!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    if kv_dtype is None:
        kv_dtype = dtype if dtype in KV_DTYPES else "bf16"
    if kv_dtype not in KV_DTYPES:
        raise ValueError(
            f"{where} kv_dtype: {kv_dtype[:40]!r} is not one of {', '.join(KV_DTYPES)}"
        )
    return dtype, kv_dtype
