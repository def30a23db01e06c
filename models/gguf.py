"""Read a GGUF file (llama.cpp's format) and dequantize its tensors, with numpy alone.

    file: "GGUF" | version u32 | tensor_count u64 | kv_count u64
          kv × kv_count        key (u64 len + utf-8) | value type u32 | value
          tensor info × count  name | n_dims u32 | dims u64[n_dims] (innermost first) | type u32
                               | offset u64 (from the data section)
          padding to ``general.alignment`` (32)
          data section

Only what a dense Llama-family checkpoint needs is read: F32, F16, BF16 and the block types
Q4_0, Q4_1 and Q8_0 (32 weights a block, one fp16 scale, Q4_1 also an fp16 minimum). Every
count and offset is checked against the file's size before anything is allocated.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_SCALARS = {  # value type -> struct format
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_SIZES = {fmt: struct.calcsize(fmt) for fmt in (*_SCALARS.values(), "<I", "<Q")}
_U64 = struct.Struct("<Q")
STRING, ARRAY = 8, 9
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
# tensor type -> (name, weights per block, bytes per block)
TENSOR_TYPES = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    BF16: ("BF16", 1, 2),
    Q4_0: ("Q4_0", 32, 18),
    Q4_1: ("Q4_1", 32, 20),
    Q8_0: ("Q8_0", 32, 34),
}
_OTHER_TYPES = {  # named in errors only: the 5-bit types, the K-quants (256-weight blocks)
    6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K",
    14: "Q6_K", 15: "Q8_K",
}  # fmt: skip


class GGUFError(ValueError):
    """A file that is not a GGUF this reader understands; the message says what is wrong."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first): ggml's dims reversed
    type: int
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """The metadata and tensor table of one GGUF file; tensor data is memory-mapped."""

    def __init__(self, path: str | Path, strings: bool = True) -> None:
        """``strings=False``: string arrays (a tokenizer's vocabulary and merges, most of the
        header) are stepped over, their fields None; for a reader that wants only tensors."""
        self.path = Path(path)
        self._read_strings = strings
        # a memory map until close(), then an empty array
        self._data: npt.NDArray[np.uint8] = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._view: memoryview | None = self._data.data  # the header, parsed by struct
        self._pos = 0
        if self._take(4).tobytes() != MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (bad magic)")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = self._scalar("<Q"), self._scalar("<Q")
        self._check_count(num_tensors + num_kv, 8)
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: bad alignment {alignment}")
        start = -(-self._pos // alignment) * alignment
        self._view = None  # the header is read; tensors are slices of the memory map
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, ttype, offset in infos:
            _, per_block, block_bytes = TENSOR_TYPES[ttype]
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if count % per_block:
                raise GGUFError(f"{self.path}: tensor {name} is not a whole number of blocks")
            t = GGUFTensor(name, shape, ttype, start + offset, count // per_block * block_bytes)
            if t.offset + t.nbytes > len(self._data):
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
            self.tensors[name] = t

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """One tensor's bytes as they are in the file (uint8, memory-mapped, read-only)."""
        t = self.tensors[name]
        return self._data[t.offset : t.offset + t.nbytes]

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32, in PyTorch order."""
        t = self.tensors[name]
        return dequantize(self.raw(name), t.type).reshape(t.shape)

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each type the file holds: {"F32": 61, "Q4_1": 210, ...}."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            name = TENSOR_TYPES[t.type][0]
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def tensor_bytes(self) -> int:
        """The weights' bytes as stored (the data section less its padding)."""
        return sum(t.nbytes for t in self.tensors.values())

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        mm = getattr(self._data, "_mmap", None)
        self._data = np.empty(0, np.uint8)
        if mm is not None:
            mm.close()

    # ---- parsing -------------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        if n < 0 or self._pos + n > len(self._data) or self._view is None:
            raise GGUFError(f"{self.path}: truncated (wanted {n} bytes at {self._pos})")
        chunk = self._view[self._pos : self._pos + n]
        self._pos += n
        return chunk

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(_SIZES[fmt]))[0]

    def _string(self) -> str:
        return str(self._take(self._scalar("<Q")), "utf-8", errors="replace")

    def _check_count(self, count: int, min_bytes_each: int) -> None:
        if count * min_bytes_each > len(self._data) - self._pos:
            raise GGUFError(f"{self.path}: a count of {count} cannot fit in the file")

    def _value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            etype, count = self._scalar("<I"), self._scalar("<Q")
            if etype in _SCALARS:  # one numpy read for numeric arrays
                dtype = np.dtype(_SCALARS[etype])
                self._check_count(count, dtype.itemsize)
                return np.frombuffer(self._take(count * dtype.itemsize), dtype).tolist()
            self._check_count(count, 8)
            if etype == STRING:  # a tokenizer's vocabulary and merges: 100k strings
                return self._strings(count)
            return [self._value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        return self._scalar(_SCALARS[vtype])

    def _strings(self, count: int) -> list[str] | None:
        """``_string()`` ``count`` times, in one loop over the header's bytes."""
        view, pos, end, out = self._view, self._pos, len(self._data), []
        read = self._read_strings
        if view is None:
            raise GGUFError(f"{self.path}: the header is already read")
        for _ in range(count):
            n = _U64.unpack_from(view, pos)[0] if pos + 8 <= end else end
            if pos + 8 + n > end:
                raise GGUFError(f"{self.path}: truncated (a string of {n} bytes at {pos})")
            if read:
                out.append(str(view[pos + 8 : pos + 8 + n], "utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out if read else None

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        if n_dims > 4:
            raise GGUFError(f"{self.path}: tensor {name} has {n_dims} dimensions")
        dims = [self._scalar("<Q") for _ in range(n_dims)]
        ttype, offset = self._scalar("<I"), self._scalar("<Q")
        if ttype not in TENSOR_TYPES:
            supported = ", ".join(v[0] for v in TENSOR_TYPES.values())
            kind = f"{_OTHER_TYPES[ttype]} (ggml type {ttype})" if ttype in _OTHER_TYPES else ttype
            raise GGUFError(
                f"{self.path}: tensor {name} has ggml type {kind}, not supported "
                f"(supported: {supported})"
            )
        return name, tuple(reversed(dims)), ttype, offset


def dequantize(raw: np.ndarray, ttype: int) -> np.ndarray:
    """Flat float32 weights from a tensor's raw bytes (``raw``: uint8)."""
    raw = np.ascontiguousarray(raw)
    if ttype == F32:
        return raw.view(np.float32).copy()
    if ttype == F16:
        return raw.view(np.float16).astype(np.float32)
    if ttype == BF16:  # the high half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    block_bytes = TENSOR_TYPES[ttype][2]
    blocks = raw.reshape(-1, block_bytes)  # [num_blocks, block_bytes]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [num_blocks, 1]
    if ttype == Q8_0:
        return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    head = 4 if ttype == Q4_1 else 2
    qs = blocks[:, head:]  # [num_blocks, 16]: weight j in the low nibble, j + 16 in the high
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # [num_blocks, 32]
    if ttype == Q4_0:
        return (d * (q - 8.0)).reshape(-1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(-1)
