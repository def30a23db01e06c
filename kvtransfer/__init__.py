"""Moving KV blocks between workers: ``base`` holds the contract, one module per backend.

Backends are imported on first use, so ``kvtransfer.base`` (used by the coordinator) stays
free of torch and of optional transports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.kvtransfer.base import KVReceiver, KVSender

if TYPE_CHECKING:
    import torch

# backend -> (sender, receiver) constructors as "module.name"; "host" is the design's name for
# host memory over ZMQ. nccl raises TransferError with engine.platform's reason where it is
# unusable.
_ZMQ = ("zmq_backend.ZmqKVSender", "zmq_backend.ZmqKVReceiver")
_BACKENDS = {
    "zmq": _ZMQ,
    "host": _ZMQ,
    "nccl": ("nccl_backend.nccl_sender", "nccl_backend.nccl_receiver"),
    "nixl": ("nixl_backend.NixlKVSender", "nixl_receiver.NixlKVReceiver"),
}


def backends() -> list[str]:
    return sorted(_BACKENDS)


def _constructors(backend: str) -> tuple[Callable[..., KVSender], Callable[..., KVReceiver]]:
    names = _BACKENDS.get(backend)
    if names is None:
        raise ValueError(
            f"unknown KV transfer backend {backend!r}; available: {', '.join(backends())}"
        )
    sender: Callable[..., KVSender] = _load(names[0])
    receiver: Callable[..., KVReceiver] = _load(names[1])
    return sender, receiver


def _load(name: str) -> Any:  # Any: a module attribute; typed where _constructors takes it
    module, attr = name.split(".")
    return getattr(importlib.import_module(f".{module}", __name__), attr)


def make_sender(backend: str, *, checksum: bool = False, **options: Any) -> KVSender:
    """A sender; ``checksum`` sends a CRC-32 of the bytes with every transfer."""
    return _constructors(backend)[0](checksum=checksum, **options)


def make_receiver(
    backend: str, kv_layers: list[torch.Tensor], bind: str | None = None, **options: Any
) -> KVReceiver:
    """A receiver writing into ``kv_layers``; ``bind`` in the backend's address form (zmq, and
    nccl's control endpoint: ``tcp://127.0.0.1:0`` or ``ipc://...``; nixl ignores it), default
    loopback on a free port."""
    make = _constructors(backend)[1]
    return make(kv_layers, **options) if bind is None else make(kv_layers, bind, **options)
