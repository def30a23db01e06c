"""Modules built with no storage and no initial values: their weights come from a checkpoint.

Under ``torch.device("meta")`` alone, ``nn.Linear`` and ``nn.Embedding`` still run their random
initialisers on the meta tensors, and torch runs those through its Python reference ops, whose
first call imports ``torch._dynamo``: 0.9 s of every worker's start (a profile of an engine's
construction), for values nobody reads. ``on_meta`` makes nn.init's functions leave a tensor
as it is meanwhile, as transformers' ``no_init_weights`` does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

# the initialisers torch's own modules call (by attribute, so a stand-in takes their place)
_INITIALISERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
)
_lock = threading.Lock()
_depth = 0
_saved: dict[str, Callable[..., Any]] = {}


def _leave(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device with nn.init's functions doing nothing (nested and
    concurrent uses share one patch, undone when the last leaves)."""
    global _depth
    with _lock:
        if _depth == 0:
            for name in _INITIALISERS:
                _saved[name] = getattr(torch.nn.init, name)
                setattr(torch.nn.init, name, _leave)
        _depth += 1
    try:
        with torch.device("meta"):
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name, fn in _saved.items():
                    setattr(torch.nn.init, name, fn)
                _saved.clear()
