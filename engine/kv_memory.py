"""How much memory a KV cache on a CPU takes when nothing sets it, and the memory it lives in.

A decode worker's cache is what bounds its streams (every running sequence holds its KV), so by
default it takes a good part of the machine; a prefill worker's only holds prompts until they
are sent, and a prefix cache::

    role              share of the machine's memory (physical, or its cgroup's limit if lower)
    decode, both      40%   (24 GiB: 9.6 GiB, 26 full 8,192-token SmolLM2 contexts in float32,
                             102 with --kv-cache-dtype int8: 68 bytes a row of 64 values)
    prefill           10%

``pdserve serve`` splits a role's share between the workers of that role it starts
(``--kv-cache-share``); ``--kv-cache-memory`` or ``--num-kv-blocks`` set it outright (vLLM's
CPU default is a fixed 4 GiB).

The cache lives in an anonymous memory mapping: the kernel hands it out as zero pages when
first written, so a large cache costs memory only as its blocks are used, and a worker starts
without writing gigabytes of zeros.
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a cache is made: pdserve serve reads the shares
    import torch

ROLE_SHARES = {"decode": 0.40, "both": 0.40, "prefill": 0.10}
DEFAULT_SHARE = ROLE_SHARES["decode"]  # an engine no role owns (``pdserve generate``, tests)
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def machine_memory() -> int:
    """Bytes of memory this process may use: physical memory, or its cgroup's limit if lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            return int(text)
    return physical


def share_budget(share: float) -> int:
    """The bytes ``share`` of the machine's memory is."""
    return int(machine_memory() * share)


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous mapping (zero pages, taken as first written)."""
    import torch

    count = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(count * itemsize, 1))
    # frombuffer keeps ``buffer`` alive as long as the tensor
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
