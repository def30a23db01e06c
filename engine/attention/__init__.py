"""Attention backends over the paged KV cache."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "make_backend"]


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` takes flashinfer on CUDA when it imports, else the torch backend."""
    if name in ("auto", "torch"):
        return TorchAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch")
