"""Which part of the model each rank of a tensor-parallel group holds (Megatron's split).

    rank r of N         holds                                      after it
    q / k / v proj      its query heads, its KV heads (rows)       -
    o_proj              the columns of its query heads             all-reduce (sum)
    gate / up proj      its slice of the intermediate rows         -
    down_proj           the same slice of columns                  all-reduce (sum)
    lm_head             its slice of the vocabulary (rows)         gathered on rank 0
    embedding, norms    all of it (a lookup reads one row a token)  -

Query heads split evenly (H % N == 0). KV heads split evenly where KV % N == 0; where there
are fewer KV heads than ranks (N % KV == 0) each rank keeps the one its query heads read, so
N / KV ranks hold a copy of each (vLLM's replication). Query head h reads KV head h // (H / KV):
rank r's query heads [r·H/N, (r+1)·H/N) read exactly its KV heads either way.

``TPLayout`` is pure arithmetic on a ``ModelConfig``: the loader asks it what to slice out of
each checkpoint tensor, the KV cache how many heads it holds, the transfer which heads a rank
owns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.engine.config import ConfigError, ModelConfig

# (dim, start, stop) of a checkpoint tensor a rank keeps; None: all of it
Slice = tuple[int, int, int] | None

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
_ROW = ("o_proj", "down_proj")  # split by input columns (weights only: a bias is added once)


def check_tp_size(cfg: ModelConfig, size: int) -> None:
    """``ConfigError`` saying why ``cfg`` cannot be split over ``size`` ranks (and which sizes
    it can), else nothing."""
    if size < 1:
        raise ConfigError(f"tensor parallel size must be >= 1, got {size}")
    reason = _why_not(cfg, size)
    if reason:
        sizes = ", ".join(str(n) for n in allowed_sizes(cfg))
        raise ConfigError(
            f"the model cannot run at tensor parallel size {size}: {reason} "
            f"(sizes it allows: {sizes})"
        )


def allowed_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    """Tensor parallel sizes up to ``limit`` that split ``cfg``."""
    return [n for n in range(1, limit + 1) if not _why_not(cfg, n)]


def _why_not(cfg: ModelConfig, n: int) -> str:
    if cfg.num_heads % n:
        return f"{cfg.num_heads} query heads do not divide by {n}"
    if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
        return f"{cfg.num_kv_heads} KV heads neither divide by {n} nor divide it"
    if cfg.intermediate_size % n:
        return f"the MLP's {cfg.intermediate_size} rows do not divide by {n}"
    return ""


@dataclass(frozen=True)
class TPLayout:
    """Rank ``rank`` of a group of ``size`` over the model ``cfg`` (checked at construction)."""

    cfg: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_tp_size(self.cfg, self.size)
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is outside a group of {self.size}")

    # ---- heads --------------------------------------------------------------------------------
    @property
    def heads(self) -> range:
        per = self.cfg.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def kv_heads(self) -> range:
        """The KV heads this rank holds (one, shared with N / KV ranks, when KV < N)."""
        return self.kv_heads_of(self.rank)

    def kv_heads_of(self, rank: int) -> range:
        kv, n = self.cfg.num_kv_heads, self.size
        if kv >= n:
            per = kv // n
            return range(rank * per, (rank + 1) * per)
        head = rank // (n // kv)
        return range(head, head + 1)

    def kv_owner(self, head: int) -> int:
        """The first rank holding KV head ``head`` (the one whose copy a transfer reads)."""
        return next(r for r in range(self.size) if head in self.kv_heads_of(r))

    @property
    def intermediate(self) -> range:
        per = self.cfg.intermediate_size // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def vocab_of(self, rank: int) -> range:
        """The vocabulary rows of the output head rank ``rank`` computes (the last rank takes
        the remainder when the vocabulary does not divide)."""
        v, n = self.cfg.vocab_size, self.size
        per = -(-v // n)
        return range(min(rank * per, v), min((rank + 1) * per, v))

    @property
    def vocab(self) -> range:
        return self.vocab_of(self.rank)

    def local_config(self) -> ModelConfig:
        """``cfg`` as this rank's modules see it: its heads and MLP rows (the vocabulary and
        hidden size stay whole)."""
        return dataclasses.replace(
            self.cfg,
            num_heads=len(self.heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
        )

    # ---- checkpoint tensors -------------------------------------------------------------------
    def slice_of(self, hf_name: str) -> Slice:
        """The part of checkpoint tensor ``hf_name`` (Hugging Face names) this rank keeps."""
        if self.size == 1:
            return None
        parts = hf_name.split(".")
        kind = next((p for p in parts if p in _COLUMN or p in _ROW), None)
        d = self.cfg.head_dim
        if kind in ("q_proj", "k_proj", "v_proj"):
            heads = self.heads if kind == "q_proj" else self.kv_heads
            return (0, heads.start * d, heads.stop * d)
        if kind in ("gate_proj", "up_proj"):
            return (0, self.intermediate.start, self.intermediate.stop)
        if kind in _ROW:
            if parts[-1] != "weight":
                return None  # the bias: every rank loads it, ranks past 0 zero it
            cols = self.intermediate if kind == "down_proj" else self.heads
            scale = 1 if kind == "down_proj" else d
            return (1, cols.start * scale, cols.stop * scale)
        if hf_name == "lm_head.weight":
            return (0, self.vocab.start, self.vocab.stop)
        return None
