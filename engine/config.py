"""Model and engine configuration: frozen dataclasses, validated with clear messages."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.engine.kv_memory import DEFAULT_SHARE

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
QUANT_ACTIVATIONS = ("auto", "float32", "int16", "int8")
# auto: the model's dtype; int8: rows of int8 values and a scale (engine/attention/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "int8")


class ConfigError(ValueError):
    """A configuration that cannot be served, with the reason in the message."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` the runtime needs."""

    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise ConfigError(f"model directory {path} does not exist")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model directory {path} has no config.json")
        return cls.from_dict(json.loads(config_file.read_text()), source=str(config_file))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
            if k not in cfg
        ]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        use_window = family == "mistral" or cfg.get("use_sliding_window", False)
        window = cfg.get("sliding_window") if use_window else None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_parse_rope(cfg, source),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: a sliding window caps it (full attention here)."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _parse_rope(cfg: dict[str, Any], source: str) -> RopeConfig:
    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters (theta inside).
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: unsupported rope type {rope_type!r}; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. ``num_blocks`` wins; else a byte budget; else a GPU fraction, or
    on a CPU a share of the machine's memory."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # on a CPU with neither set: this share of the machine's memory (engine/kv_memory.py)
    cpu_memory_share: float = DEFAULT_SHARE
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be {' or '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.cpu_memory_share <= 0.9:
            raise ConfigError(
                f"the KV cache share of the memory must be in (0, 0.9], got {self.cpu_memory_share}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A prompt longer than this many tokens per step is split over several steps.
    long_prefill_token_threshold: int | None = None
    # Seconds one step may take: at start-up the engine lowers max_num_batched_tokens to
    # what runs within it here (engine/step_budget.py). <= 0: off. Half a second bounds how
    # long a prefill chunk stalls the decode streams batched with it, while the fixed cost of
    # a step (~30 ms for SmolLM2-135M on one CPU core) stays near 6% of it (12% at 0.25 s);
    # a 2,048-token chunk of a 7-8B model on a GPU takes ~0.1 s, so GPUs keep the max.
    max_step_time_s: float = 0.5
    # What a step carrying decodes should take (stall-free chunked prefill: engine/scheduler.py,
    # engine/step_model.py): None: auto (DEFAULT_TPOT_TARGET_S, or twice a lone decode step
    # here when that is longer); <= 0: no target (prompt chunks fill the budget).
    tpot_target_s: float | None = None
    # Prompts going this long without a token computed take a block a step past the target.
    prefill_age_bound_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not math.isfinite(self.max_step_time_s):
            raise ConfigError(
                f"max_step_time_s must be a number of seconds (<= 0: off), "
                f"got {self.max_step_time_s}"
            )
        if self.tpot_target_s is not None and not math.isfinite(self.tpot_target_s):
            raise ConfigError(
                f"tpot_target_s must be a number of seconds (<= 0: off), got {self.tpot_target_s}"
            )
        if not (math.isfinite(self.prefill_age_bound_s) and self.prefill_age_bound_s > 0):
            raise ConfigError(
                f"prefill_age_bound_s must be a positive number of seconds, "
                f"got {self.prefill_age_bound_s}"
            )


SPECULATIVE_MODES = ("off", "ngram", "draft")
SPEC_SWITCHES = ("auto", "on", "off")
MAX_SPEC_TOKENS = 16  # drafts a step may verify per sequence (``protocol.control`` bounds)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec/): ``mode`` off, ngram (prompt lookup over the
    prompt and the output so far) or draft (``draft_model``, a smaller model sharing the
    tokenizer, its KV paged beside the target's); ``num_tokens`` drafts a step verifies per
    sequence; ``switch``: auto (each step speculates only where the step-time model says it
    pays), on (whenever there are drafts), off (never: a draft model's KV is still kept, so a
    worker pairs with the same others)."""

    mode: str = "off"
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None
    draft_quantization: str = "auto"
    switch: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in SPECULATIVE_MODES:
            modes = ", ".join(SPECULATIVE_MODES)
            raise ConfigError(f"speculative must be {modes}, got {self.mode!r}")
        if self.switch not in SPEC_SWITCHES:
            switches = ", ".join(SPEC_SWITCHES)
            raise ConfigError(f"spec switch must be {switches}, got {self.switch!r}")
        if not 1 <= self.num_tokens <= MAX_SPEC_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, {MAX_SPEC_TOKENS}], got {self.num_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= 64:
            raise ConfigError(
                f"need 1 <= ngram_min <= ngram_max <= 64, got {self.ngram_min}, {self.ngram_max}"
            )
        if self.mode == "draft" and not self.draft_model:
            raise ConfigError("--speculative draft needs --draft-model")
        if self.draft_quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"draft quantization must be {', '.join(QUANTIZATIONS)}, "
                f"got {self.draft_quantization!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    attention_backend: str = "auto"  # auto | torch | flashinfer
    cpu_linear: str = "auto"  # auto | onednn | torch: how CPU linear layers run (cpu_linear.py)
    max_model_len: int | None = None
    seed: int = 0
    threads: int | None = None
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, no CUDA graphs
    compile: bool = False  # CPU: decode steps through torch.compile (engine/compile.py)
    # auto | none | int8 | int4: the linear layers' weights (engine/loader.py, engine/quant/)
    quantization: str = "auto"
    quant_group_size: int = 32  # int4: weights per scale and minimum
    # auto | float32 | int16 | int8: quantized layers' activations on a CPU (quant/qdot.py)
    quant_activations: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # tensor parallelism (engine/tp/): ranks in the group; where they meet ("": rank 0 starts
    # the others on this host; tcp://host:port: they are started apart, ``pdserve tp-rank``);
    # seconds a collective may wait; rank 0's full-head blocks for KV transfers (0: auto)
    tensor_parallel_size: int = 1
    tp_rendezvous: str = ""
    tp_timeout_s: float = 30.0
    tp_staging_blocks: int = 0
    tp_join_timeout_s: float = 300.0  # how long ranks wait for each other at the rendezvous
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.cpu_linear not in ("auto", "onednn", "torch"):
            raise ConfigError(f"cpu_linear must be auto, onednn or torch, got {self.cpu_linear!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise ConfigError(
                f"quant_activations must be {', '.join(QUANT_ACTIVATIONS)}, "
                f"got {self.quant_activations!r}"
            )
        if self.quant_group_size < 32 or self.quant_group_size % 32:
            raise ConfigError(
                f"quant_group_size must be a positive multiple of 32, got {self.quant_group_size}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.compile:
            raise ConfigError("--compile does not run in a tensor-parallel group yet")
        if self.cache.kv_cache_dtype == "int8":
            if not self.device.startswith("cpu"):
                raise ConfigError(f"int8 KV cache is CPU-only for now (device {self.device!r})")
            if self.compile or self.tensor_parallel_size > 1:
                raise ConfigError(
                    "int8 KV cache does not run with --compile or in a tensor-parallel group yet"
                )
        if self.speculative.mode == "draft" and self.tensor_parallel_size > 1:
            raise ConfigError("--speculative draft does not run in a tensor-parallel group yet")
        if not self.tp_timeout_s > 0:
            raise ConfigError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        if self.compile and not self.device.startswith("cpu"):
            raise ConfigError(
                f"compile is for CPU decode steps (CUDA ones use CUDA graphs), "
                f"device is {self.device!r}"
            )


def served_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence served: ``max_model_len`` if set, within what the model allows."""
    return min(config.max_model_len or model_config.max_model_len, model_config.max_model_len)
