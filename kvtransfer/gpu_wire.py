"""What the GPU transfer backends (``cuda_ipc``, ``nccl``) say over their ZMQ control channel,
how CUDA IPC handles travel, and the device-side checksum.

Control channel: the receiver binds a ROUTER (its ``address``), each sender a DEALER::

    sender                                       receiver
    Hello(backend, layout, pid, gpu) ──────────▶ checks the layout (and, nccl, distinct GPUs)
                                     ◀────────── IpcHandles(...)  | NcclUniqueId(...) | Refused
    Begin(rid, dst_ids) ───────────────────────▶ grants it only while rid is PENDING with
                                     ◀────────── BeginReply(ok)     exactly these blocks
    ...KV moves on the GPU...
    Done(rid, layers, checksum) ───────────────▶ verifies, then DONE | FAILED

Each message is one msgpack frame ``{"type": tag, "v": WIRE_VERSION, fields...}``, decoded as
strictly as ``protocol`` messages (same field checks); nothing is ever unpickled. The tags
live here, not in ``protocol.messages``, because only these two backends speak them.
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
class IpcTensor:
    """One CUDA tensor as ``torch.multiprocessing.reductions.reduce_tensor`` shares it."""

    shape: list[int]
    stride: list[int]
    offset: int  # elements into its storage
    storage_kind: str  # "TypedStorage" | "UntypedStorage"
    dtype: str
    device: int  # the exporter's device index (the importer maps the GPU by uuid)
    handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


@dataclass(frozen=True)
class Hello:
    backend: str  # "cuda_ipc" | "nccl"
    layout: KVLayout
    pid: int
    gpu: str  # the sender's GPU uuid ("" if unknown)


@dataclass(frozen=True)
class IpcHandles:
    session: str  # changes when the receiver restarts: handles must be opened again
    pid: int
    gpu: str
    layers: list[IpcTensor]


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
    IpcHandles: "ipc_handles",
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
    check_fields(type(msg), body, type(msg).__name__, Frames([b""]))
    return msgpack.packb({"type": tag, "v": WIRE_VERSION, **body}, use_bin_type=True)


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


# ---- CUDA IPC handles --------------------------------------------------------------------------

_STORAGE_KINDS = {
    "TypedStorage": torch.storage.TypedStorage,
    "UntypedStorage": torch.UntypedStorage,
}


def ipc_tensor_from_reduction(rebuild: Any, args: tuple) -> IpcTensor:
    """``reduce_tensor``'s output as data; ``ValueError`` for a reduction this code does not
    know (a CPU tensor, or a torch whose ``rebuild_cuda_tensor`` arguments changed)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise ValueError(
            f"not a CUDA tensor reduction this torch ({torch.__version__}) path understands"
        )
    (_, size, stride, offset, storage_cls, dtype, device, handle, size_bytes, offset_bytes,
     _, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    kind = storage_cls.__name__
    if _STORAGE_KINDS.get(kind) is not storage_cls:
        raise ValueError(f"unexpected storage class {storage_cls!r}")
    return IpcTensor(
        shape=list(size),
        stride=list(stride),
        offset=int(offset),
        storage_kind=kind,
        dtype=str(dtype).removeprefix("torch."),
        device=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size_bytes),
        storage_offset_bytes=int(offset_bytes),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync),
    )


def rebuild_args(t: IpcTensor, device: int) -> tuple:
    """Arguments for ``rebuild_cuda_tensor`` opening ``t`` on local device ``device``."""
    storage_cls = _STORAGE_KINDS.get(t.storage_kind)
    if storage_cls is None:
        raise ValueError(f"unknown storage kind {t.storage_kind!r}")
    dtype = getattr(torch, t.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {t.dtype!r}")
    return (
        torch.Tensor, torch.Size(t.shape), tuple(t.stride), t.offset, storage_cls, dtype,
        device, t.handle, t.storage_size_bytes, t.storage_offset_bytes, False,
        t.ref_counter_handle, t.ref_counter_offset, t.event_handle, t.event_sync_required,
    )  # fmt: skip


def export_tensor(t: torch.Tensor) -> IpcTensor:
    from torch.multiprocessing.reductions import reduce_tensor

    return ipc_tensor_from_reduction(*reduce_tensor(t))


def open_tensor(t: IpcTensor, device: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*rebuild_args(t, device))


def gpu_uuid(device: torch.device) -> str:
    """A GPU's identity across processes (indices differ under CUDA_VISIBLE_DEVICES)."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return ""


def local_device_for(uuid: str, fallback: int) -> int | None:
    """This process's index of the GPU with ``uuid``; ``fallback`` when uuids are unknown."""
    if not uuid:
        return fallback
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(torch.device("cuda", i)) == uuid:
            return i
    return None


# ---- layers and checksum ------------------------------------------------------------------------


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
