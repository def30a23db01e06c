"""Moving KV blocks between workers: ``base`` holds the contract, one module per backend.

Backends are imported on first use, so ``kvtransfer.base`` (used by the coordinator) stays
free of torch and of optional transports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pdserve.kvtransfer.base import KVReceiver, KVSender

if TYPE_CHECKING:
    import torch

# backend -> (sender, receiver) as "module.Class"; "host" is the design's name for host memory
# over ZMQ. nccl raises TransferError with engine.platform's reason where it is unusable.
_ZMQ = ("zmq_backend.ZmqKVSender", "zmq_backend.ZmqKVReceiver")
_BACKENDS = {
    "zmq": _ZMQ,
    "host": _ZMQ,
    "nccl": ("nccl_backend.NcclKVSender", "nccl_backend.NcclKVReceiver"),
    "nixl": ("nixl_backend.NixlKVSender", "nixl_receiver.NixlKVReceiver"),
}


def backends() -> list[str]:
    return sorted(_BACKENDS)


def _classes(backend: str) -> tuple[type[KVSender], type[KVReceiver]]:
    names = _BACKENDS.get(backend)
    if names is None:
        raise ValueError(
            f"unknown KV transfer backend {backend!r}; available: {', '.join(backends())}"
        )
    return _load(names[0]), _load(names[1])


def _load(name: str) -> type:
    module, cls = name.split(".")
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def make_sender(backend: str, *, checksum: bool = False, **options: Any) -> KVSender:
    """A sender; ``checksum`` sends a CRC-32 of the bytes with every transfer."""
    return _classes(backend)[0](checksum=checksum, **options)


def make_receiver(
    backend: str, kv_layers: list[torch.Tensor], bind: str | None = None, **options: Any
) -> KVReceiver:
    """A receiver writing into ``kv_layers``; ``bind`` in the backend's address form (zmq, and
    nccl's control endpoint: ``tcp://127.0.0.1:0`` or ``ipc://...``; nixl ignores it), default
    loopback on a free port."""
    cls = _classes(backend)[1]
    return cls(kv_layers, **options) if bind is None else cls(kv_layers, bind, **options)
