"""What the host-memory backends share: layout checks, block gather/scatter, checksums and
headers (the table of transfer states is ``table.py``).

Per layer, a transfer moves one contiguous buffer::

    kv_layers[l]                    [num_blocks, 2, block_size, num_kv_heads, head_dim]
    gather(kv_layers, src_ids)[l]   [len(src_ids), 2, block_size, num_kv_heads, head_dim]
    scatter: kv_layers[l][dst_ids[i]] = buffer[l][i]

Blocks move as they are stored: an int8 cache's (``--kv-cache-dtype int8``) rows are head_dim
int8 values and a float32 scale, so its layout says dtype int8, head_dim D + 4 (a row's bytes).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch

from pdserve.kvtransfer.base import KVLayout
from pdserve.protocol.messages import KVHeader

Buffer = bytes | bytearray | memoryview


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def layout_of(kv_layers: Sequence[torch.Tensor]) -> KVLayout:
    """The layout of a paged KV cache; ``ValueError`` if its layers disagree or are malformed."""
    if not kv_layers:
        raise ValueError("KV cache has no layers")
    first = kv_layers[0]
    if first.dim() != 5 or first.shape[1] != 2:
        raise ValueError(
            f"KV layer must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
            f"got {list(first.shape)}"
        )
    for i, layer in enumerate(kv_layers):
        if layer.shape != first.shape or layer.dtype != first.dtype:
            raise ValueError(
                f"KV layer {i} is {list(layer.shape)} {layer.dtype}, "
                f"layer 0 is {list(first.shape)} {first.dtype}"
            )
    _, _, block_size, heads, head_dim = first.shape
    return KVLayout(
        block_size=block_size,
        dtype=dtype_name(first.dtype),
        num_layers=len(kv_layers),
        num_kv_heads=heads,
        head_dim=head_dim,
    )


def check_host_layers(kv_layers: Sequence[torch.Tensor]) -> KVLayout:
    """``layout_of``, plus: every layer is a contiguous CPU tensor (what host backends need)."""
    layout = layout_of(kv_layers)
    for i, layer in enumerate(kv_layers):
        if layer.device.type != "cpu" or not layer.is_contiguous():
            raise ValueError(f"KV layer {i} must be a contiguous CPU tensor, got {layer.device}")
    return layout


def block_shape(layout: KVLayout) -> list[int]:
    return [2, layout.block_size, layout.num_kv_heads, layout.head_dim]


def layer_nbytes(layout: KVLayout, num_blocks: int) -> int:
    itemsize = torch.empty((), dtype=torch_dtype(layout.dtype)).element_size()
    return num_blocks * math.prod(block_shape(layout)) * itemsize


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    if not block_ids:
        raise ValueError(f"{what}: no block ids")
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what}: block ids {bad[:8]} outside [0, {num_blocks})")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"{what}: repeated block ids")


def gather(kv_layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Copies of the listed blocks, one contiguous ``[n, 2, bs, H, D]`` tensor per layer."""
    index = torch.tensor(block_ids, dtype=torch.long)
    return [layer.index_select(0, index) for layer in kv_layers]


def as_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def checksum(buffers: Sequence[Buffer]) -> bytes:
    """CRC-32 over every buffer in order (4 bytes): it catches flipped, lost and reordered
    bytes, not an adversary, at ~4 GB/s (blake2b's ~1 GB/s cost a decode core ~12 ms for
    one 1,024-token prompt of the small model)."""
    crc = 0
    for buf in buffers:
        crc = zlib.crc32(buf, crc)
    return crc.to_bytes(4, "big")


def make_header(
    request_id: str,
    dst_block_ids: Sequence[int],
    staged: Sequence[torch.Tensor],
    *,
    with_checksum: bool,
    secret: bytes = b"",
) -> KVHeader:
    return KVHeader(
        request_id=request_id,
        dst_block_ids=list(dst_block_ids),
        num_layers=len(staged),
        dtype=dtype_name(staged[0].dtype),
        block_shape=list(staged[0].shape[1:]),
        checksum=checksum([as_bytes(t) for t in staged]) if with_checksum else None,
        secret=secret,
    )


def header_problem(
    h: KVHeader, layout: KVLayout, dst_block_ids: list[int], require_checksum: bool
) -> str | None:
    """Why a transfer's header does not fit the expected one, or None when it does."""
    if require_checksum and h.checksum is None:
        return "no checksum sent, one is required"
    if h.num_layers != layout.num_layers:
        return f"{h.num_layers} layers sent, the cache has {layout.num_layers}"
    if h.dtype != layout.dtype:
        return f"dtype {h.dtype!r} sent, the cache holds {layout.dtype!r}"
    if h.block_shape != block_shape(layout):
        return f"block shape {h.block_shape} sent, the cache has {block_shape(layout)}"
    if h.dst_block_ids != dst_block_ids:
        return f"destination blocks {h.dst_block_ids[:8]} differ from the expected ones"
    return None


def payload_problem(h: KVHeader, layout: KVLayout, buffers: Sequence[Buffer]) -> str | None:
    """Why the layer buffers do not match their (already checked) header, or None."""
    if len(buffers) != layout.num_layers:
        return f"{len(buffers)} layer buffers for {layout.num_layers} layers"
    want = layer_nbytes(layout, len(h.dst_block_ids))
    sizes = {memoryview(b).nbytes for b in buffers}
    if sizes != {want}:
        return f"layer buffers of {sorted(sizes)} bytes, expected {want}"
    if h.checksum is not None and checksum(buffers) != h.checksum:
        return "checksum mismatch"
    return None


def scatter(
    kv_layers: Sequence[torch.Tensor], dst_block_ids: list[int], buffers: Sequence[Buffer]
) -> None:
    """kv_layers[l][dst_block_ids[i]] = block i of buffers[l], for every layer."""
    index = torch.tensor(dst_block_ids, dtype=torch.long)
    for layer, buf in zip(kv_layers, buffers, strict=True):
        src = torch.frombuffer(buf, dtype=torch.uint8).view(layer.dtype)
        layer.index_copy_(0, index, src.view(len(dst_block_ids), *layer.shape[1:]))
