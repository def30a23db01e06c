"""What the ``nccl`` backend says over its ZMQ control channel, and the device-side checksum.

Control channel: the receiver binds a ROUTER (its ``address``), each sender a DEALER::

    sender                                       receiver
    Hello(backend, layout, pid, gpu) ──────────▶ checks the layout and that the GPUs differ
                                     ◀────────── NcclUniqueId(...) | Refused
    Begin(rid, dst_ids) ───────────────────────▶ grants it only while rid is PENDING with
                                     ◀────────── BeginReply(ok)     exactly these blocks
    ...KV moves on the GPU...
    Done(rid, layers, checksum) ───────────────▶ verifies, then DONE | FAILED

Each message is one msgpack frame ``{"type": tag, "v": WIRE_VERSION, fields...}``, decoded as
strictly as ``protocol`` messages (same field checks); nothing is ever unpickled. The tags
live here, not in ``protocol.messages``, because only this backend speaks them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from pdserve.kvtransfer.common import layout_of
from pdserve.protocol.checks import Frames, ProtocolError, check_fields
from pdserve.protocol.control import KVLayout

WIRE_VERSION = 1


@dataclass(frozen=True)
class Hello:
    backend: str  # "nccl"; a receiver refuses another backend's Hello
    layout: KVLayout
    pid: int
    gpu: str  # the sender's GPU uuid ("" if unknown)


@dataclass(frozen=True)
class NcclUniqueId:
    session: str
    unique_id: list[int]  # ncclUniqueId bytes as cupy gives them (signed chars)


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Begin:
    request_id: str
    dst_block_ids: list[int]
    secret: bytes = b""  # the reservation's transfer secret (``TransferSpec.secret``)


@dataclass(frozen=True)
class BeginReply:
    request_id: str
    session: str
    ok: bool
    reason: str


@dataclass(frozen=True)
class Done:
    request_id: str
    layers: int  # layers actually written (a truncated transfer says so)
    checksum: bytes | None


TAGS: dict[type, str] = {
    Hello: "gpu_hello",
    NcclUniqueId: "nccl_unique_id",
    Refused: "gpu_refused",
    Begin: "gpu_begin",
    BeginReply: "gpu_begin_reply",
    Done: "gpu_done",
}
_BY_TAG = {tag: cls for cls, tag in TAGS.items()}


def encode(msg: Any) -> bytes:
    tag = TAGS.get(type(msg))
    if tag is None:
        raise ProtocolError(f"{type(msg).__name__} is not a GPU control message")
    body = dataclasses.asdict(msg)
    # checked as decode checks it (a copy typed as any map, which check_fields reads)
    check_fields(type(msg), dict(body.items()), type(msg).__name__, Frames([b""]))
    frame: bytes = msgpack.packb({"type": tag, "v": WIRE_VERSION, **body}, use_bin_type=True)
    return frame


def decode(frame: bytes | memoryview) -> Any:
    """The message in ``frame``; ``ProtocolError`` for anything else."""
    try:
        head = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"not valid msgpack: {exc}") from None
    if not isinstance(head, dict):
        raise ProtocolError(f"a GPU control message is a map, got {type(head).__name__}")
    tag = head.pop("type", None)
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown GPU control message type {tag!r:.40}")
    version = head.pop("v", None)
    if type(version) is not int or version != WIRE_VERSION:
        raise ProtocolError(f"{cls.__name__}: wire version is not {WIRE_VERSION}")
    return check_fields(cls, head, cls.__name__, Frames([b""]))


def require(status: tuple[bool, str], backend: str) -> None:
    """``TransferError`` naming why ``backend`` cannot run here (from ``engine.platform``)."""
    usable, reason = status
    if not usable:
        from pdserve.kvtransfer.base import TransferError

        raise TransferError(f"{backend} KV transfer is unusable here: {reason}")


# ---- GPUs, layers and checksum -------------------------------------------------------------------


def gpu_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (indices differ under CUDA_VISIBLE_DEVICES)."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return ""


def check_device_layers(kv_layers: list[torch.Tensor]) -> KVLayout:
    """``layout_of``, plus: contiguous CUDA tensors on one device."""
    layout = layout_of(kv_layers)
    device = kv_layers[0].device
    for i, layer in enumerate(kv_layers):
        if layer.device.type != "cuda" or layer.device != device or not layer.is_contiguous():
            raise ValueError(
                f"KV layer {i} must be a contiguous CUDA tensor on {device}, got {layer.device}"
            )
    return layout


class DeviceChecksum:
    """A 16-byte digest of the listed blocks of every layer, computed where they live.

    Per block, the weighted sum of its 16-bit words (weights fixed in [1, 2^16), int64, no
    overflow); the [layers, blocks] sums go to the host and through blake2b. Any changed,
    missing or reordered block changes it (barring collisions); host bytes never move.
    """

    def __init__(self) -> None:
        self._weights: dict[tuple[int, str], torch.Tensor] = {}

    def __call__(self, kv_layers: list[torch.Tensor], block_ids: list[int]) -> bytes:
        device = kv_layers[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        sums = []
        for layer in kv_layers:
            words = layer.index_select(0, index).reshape(len(block_ids), -1).view(torch.int16)
            w = self._weight(words.shape[1], device)
            sums.append((words.to(torch.int64) * w).sum(dim=1))
        return hashlib.blake2b(torch.stack(sums).cpu().numpy().tobytes(), digest_size=16).digest()

    def _weight(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, str(device))
        if key not in self._weights:
            g = torch.Generator().manual_seed(0x9E3779B9)
            self._weights[key] = torch.randint(1, 1 << 16, (n,), generator=g).to(device)
        return self._weights[key]
