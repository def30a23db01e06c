"""GGUF tensors as ``QuantWeight``s, block for block: the quantized codes are never expanded.

    Q8_0  block (34 bytes) = d fp16 | q int8 × 32            -> i8, group 32, scale d
    Q4_0  block (18 bytes) = d fp16 | nibbles × 16           -> u4, group 32, scale d, min -8·d
    Q4_1  block (20 bytes) = d fp16 | m fp16 | nibbles × 16  -> u4, group 32, scale d, min m

A tensor's blocks run along its rows: read as records [N, K // 32], the fields give the scales
(and mins) [N, K // 32] and the codes [N, K] (i8) or [N, K // 2] (u4) directly; the nibble
bytes keep their order (llama.cpp's Q4 order is ``QuantWeight``'s). -8·d is exact in fp16 (a
power of two), so Q4_0's dequantized weights equal llama.cpp's (q·d - 8·d: bit for bit but
for the sign of a zero, +0 where (q - 8)·d with d < 0 gives -0).

llama.cpp stores attn_q / attn_k with each head's rotary halves interleaved; ``quant_weight``
with ``rotary_heads`` moves whole rows (codes, scales and mins alike) back to Hugging Face's
order, the permutation ``models/gguf_convert.py`` applies to floats. The K-quants (256-weight
super-blocks with 6-bit sub-scales, another nibble order) are not read: ``models/gguf.py``
refuses such a file, naming the tensor and its type.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.quant.weights import BLOCK, QuantWeight, dequantize
from pdserve.models.gguf import Q4_0, Q4_1, Q8_0, TENSOR_TYPES, GGUFFile
from pdserve.models.gguf_convert import unpermute_rotary

QUANTIZED = (Q4_0, Q4_1, Q8_0)
_BLOCKS = {  # one block as a record: copying a field copies whole fields, not bytes
    Q8_0: np.dtype([("d", "<f2"), ("qs", "V32")]),
    Q4_0: np.dtype([("d", "<f2"), ("qs", "V16")]),
    Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "V16")]),
}


def type_name(ttype: int) -> str:
    return TENSOR_TYPES[ttype][0]


def quant_weight(
    f: GGUFFile,
    name: str,
    rotary_heads: int | None = None,
    part: tuple[int, int, int] | None = None,
) -> QuantWeight:
    """GGUF tensor ``name`` (Q8_0, Q4_0 or Q4_1, 2-D) as a ``QuantWeight``; ``rotary_heads``:
    undo llama.cpp's Q/K row order for that many heads (of those read); ``part``: (dim, start,
    stop), only those rows (dim 0: whole heads, for Q/K) or columns (dim 1, on block edges)
    read from the file."""
    t = f.tensors[name]
    if t.type not in QUANTIZED or len(t.shape) != 2:
        raise ValueError(
            f"{f.path}: tensor {name} is {type_name(t.type)} {list(t.shape)}; "
            "only 2-D Q8_0, Q4_0 and Q4_1 tensors are kept quantized"
        )
    n, k = t.shape
    blocks = f.raw(name).view(_BLOCKS[t.type]).reshape(n, k // BLOCK)  # [N, K // 32] blocks
    if part is not None:
        dim, start, stop = part
        if dim == 1 and (start % BLOCK or stop % BLOCK):
            raise ValueError(
                f"{f.path}: tensor {name}: columns [{start}, {stop}) of a tensor-parallel rank "
                f"do not fall on its {BLOCK}-weight blocks"
            )
        blocks = blocks[start:stop] if dim == 0 else blocks[:, start // BLOCK : stop // BLOCK]
        n, k = blocks.shape[0], blocks.shape[1] * BLOCK
    scales = _copy(blocks["d"])  # [N, K // 32] float16
    codes = _copy(blocks["qs"]).view(np.int8 if t.type == Q8_0 else np.uint8).reshape(n, -1)
    mins = None  # i8
    if t.type == Q4_1:
        mins = _copy(blocks["m"])
    elif t.type == Q4_0:
        mins = _q4_0_mins(scales, f, name)
    if rotary_heads is not None:
        codes = unpermute_rotary(codes, rotary_heads)  # whole rows: codes, scales, mins alike
        scales = unpermute_rotary(scales, rotary_heads)
        mins = None if mins is None else unpermute_rotary(mins, rotary_heads)
    return QuantWeight(
        kind="i8" if t.type == Q8_0 else "u4",
        data=_torch(codes),
        scales=_torch(scales),
        mins=None if mins is None else _torch(mins),
        group=BLOCK,
        name=type_name(t.type),
    )


def float_tensor(f: GGUFFile, name: str, rotary_heads: int | None = None) -> torch.Tensor:
    """Any GGUF tensor as float32 (the dequantized weights for a block type), PyTorch order."""
    w = f.dequantize(name)
    if rotary_heads is not None:
        w = unpermute_rotary(w, rotary_heads)
    return torch.from_numpy(np.ascontiguousarray(w))


def dequantize_into(w: QuantWeight, out: torch.Tensor) -> None:
    """``dequantize(w)`` written into ``out`` [N, K] (any float dtype or device): an i8 weight
    into float32 CPU memory without a float32 temporary (a vocabulary-sized embedding)."""
    n, k = w.shape
    direct = out.dtype == torch.float32 and out.device == w.data.device and out.is_contiguous()
    if w.kind == "i8" and direct:  # q exact in float32, times s: dequantize's values
        groups = out.view(n, k // w.group, w.group)
        groups.copy_(w.data.view(groups.shape))
        groups.mul_(w.scales.float().unsqueeze(-1))
    else:
        out.copy_(dequantize(w))


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """One ``QuantWeight`` whose rows are ``parts``' in order (a fused q/k/v or gate/up);
    the parts must share their kind and group."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(p.kind != first.kind or p.group != first.group for p in parts):
        kinds = ", ".join(f"{p.name} ({p.kind}, group {p.group})" for p in parts)
        raise ValueError(f"cannot fuse weights of different kinds or groups: {kinds}")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    return QuantWeight(
        kind=first.kind,
        data=torch.cat([p.data for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        mins=mins,
        group=first.group,
        name="+".join(sorted({p.name for p in parts})),
    )


def _q4_0_mins(scales: np.ndarray, f: GGUFFile, name: str) -> np.ndarray:
    """Q4_0's w = (q - 8)·d as q·d + min: min = -8·d, exact in fp16 unless it overflows."""
    with np.errstate(over="ignore"):
        mins = scales * np.float16(-8)
    if not np.isfinite(mins).all() and np.isfinite(scales).all():
        raise ValueError(f"{f.path}: tensor {name} has a Q4_0 scale too large for min = -8·d")
    return mins


def _copy(a: np.ndarray) -> np.ndarray:
    """A C-ordered copy: never a view of the file's memory map, which closes after loading."""
    return np.array(a, order="C", copy=True)


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))
