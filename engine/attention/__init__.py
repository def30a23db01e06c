"""Attention backends over the paged KV cache."""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata
from pdserve.engine.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.config import ConfigError

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "make_backend"]

BACKENDS = ("auto", "torch", "flashinfer")


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` takes flashinfer on CUDA when it imports, else the torch backend."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
    from pdserve.engine.platform import flashinfer_status

    usable, reason = flashinfer_status()
    if device.type != "cuda":
        usable, reason = False, f"device is {device}, flashinfer needs a CUDA device; {reason}"
    if usable:
        from pdserve.engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    if name == "flashinfer":
        raise ConfigError(f"attention backend 'flashinfer' is unusable here: {reason}")
    return TorchAttentionBackend(device)
