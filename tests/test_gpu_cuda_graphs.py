"""CUDA-graph decode on CPU: bucket and padding choices by exact value, the masked K/V write,
and why graphs are off (the padded step itself: test_gpu_flashinfer_fake.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import TorchAttentionBackend
from pdserve.engine.attention.flashinfer_backend import write_kv_masked
from pdserve.engine.cli_args import add_engine_args, engine_config_from_args
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import (
    bucket_for,
    capture_sizes,
    decode_slots,
    graphs_unusable_reason,
    pad_decode,
    pad_slot,
)
from tests.engine_util import make_engine


def test_capture_sizes_and_buckets() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"max_num_seqs must be >= 1, got 0"):
        capture_sizes(0)
    sizes = capture_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 16, 17, 33, 48, 49)] == [
        1, 2, 4, 8, 16, 32, 48, 48, None,
    ]  # fmt: skip


def test_pad_slot_and_padding() -> None:
    assert pad_slot([]) == 0
    assert pad_slot([1, 2]) == 0
    assert pad_slot([0, 1, 2, 5]) == 3
    assert pad_slot([0, 0, 1]) == 2
    # context 17 -> new token at position 16: block table[1] = 9, row 0; context 3 -> 2*16 + 2
    assert decode_slots([17, 3], [[5, 9, 4], [2]], 16) == [144, 34]
    padded = pad_decode([17, 3], [[5, 9, 4], [2]], 16, 4)
    assert padded.seq_lens == [17, 3, 1, 1]
    assert padded.block_tables == [[5, 9], [2], [0], [0]]
    assert (padded.pad_slot, padded.num_real) == (0, 2)
    # slot 0 taken by a real row: padding moves to slot 1 (block 0, row 1: a context of 2)
    padded = pad_decode([1, 5], [[0], [3, 6, 8]], 4, 4)
    assert decode_slots([1, 5], [[0], [3, 6, 8]], 4) == [0, 24]
    assert padded.pad_slot == 1
    assert padded.seq_lens == [1, 5, 2, 2]
    assert padded.block_tables == [[0], [3, 6], [0], [0]]
    full = pad_decode([4], [[7]], 4, 1)  # a full bucket: nothing padded
    assert (full.seq_lens, full.block_tables, full.num_real) == ([4], [[7]], 1)
    with pytest.raises(ValueError, match=r"3 rows do not fit a bucket of 2"):
        pad_decode([1, 1, 1], [[0], [1], [2]], 4, 2)


def test_write_kv_masked_keeps_padding_slots() -> None:
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(3, 2, 4, 2, 8, generator=g)  # [blocks, K/V, block_size, KV, D]
    before = cache.clone()
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    slots = torch.tensor([5, 10, 3, 3])  # rows 2 and 3 are padding on slot 3
    valid = torch.tensor([True, True, False, False])
    write_kv_masked(cache, slots, valid, k, v)
    assert torch.equal(cache[1, 0, 1], k[0]) and torch.equal(cache[1, 1, 1], v[0])
    assert torch.equal(cache[2, 0, 2], k[1]) and torch.equal(cache[2, 1, 2], v[1])
    untouched = torch.ones(3, 4, dtype=torch.bool)
    untouched[1, 1] = untouched[2, 2] = False
    assert torch.equal(cache.transpose(1, 2)[untouched], before.transpose(1, 2)[untouched])


class NoKernels:
    name = "flashinfer"
    supports_cuda_graphs = True

    def kernel_supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return False


def test_graphs_off_reasons_and_flag(tiny_dir) -> None:
    import argparse

    torch_backend = TorchAttentionBackend(torch.device("cpu"), cpu_kernel=False)
    eager = EngineConfig(model="m", enforce_eager=True)
    assert graphs_unusable_reason(eager, torch_backend, torch.bfloat16, 128) == (
        "enforce_eager is set"
    )
    assert graphs_unusable_reason(EngineConfig(model="m"), torch_backend, torch.bfloat16, 128) == (
        "the torch attention backend cannot be captured"
    )
    assert graphs_unusable_reason(EngineConfig(model="m"), NoKernels(), torch.float32, 16) == (
        "flashinfer has no kernel for torch.float32 with head size 16"
    )
    assert EngineConfig(model="m").enforce_eager is False
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(tiny_dir), "--enforce-eager"])
    assert engine_config_from_args(args).enforce_eager is True
    assert make_engine(tiny_dir).runner.graphs is None  # CPU: never captured
