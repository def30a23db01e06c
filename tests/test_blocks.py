"""protocol.blocks: the one block arithmetic, exact at and around block boundaries."""

from __future__ import annotations

import pytest

from pdserve.protocol.blocks import (
    blocks_for,
    fork_blocks,
    full_blocks,
    resume_blocks,
    tail_tokens,
)


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks"),
    [(0, 4, 0), (1, 4, 1), (3, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (16, 16, 1),
     (17, 16, 2), (1, 1, 1), (7, 1, 7)],
)  # fmt: skip
def test_blocks_for(tokens: int, block_size: int, blocks: int) -> None:
    assert blocks_for(tokens, block_size) == blocks


@pytest.mark.parametrize(
    ("tokens", "block_size", "full", "tail"),
    [(0, 4, 0, 0), (1, 4, 0, 1), (3, 4, 0, 3), (4, 4, 1, 0), (5, 4, 1, 1), (8, 4, 2, 0),
     (9, 4, 2, 1), (10, 4, 2, 2), (15, 16, 0, 15), (16, 16, 1, 0), (17, 16, 1, 1), (7, 1, 7, 0)],
)  # fmt: skip
def test_full_blocks_and_tail_tokens(tokens: int, block_size: int, full: int, tail: int) -> None:
    assert full_blocks(tokens, block_size) == full
    assert tail_tokens(tokens, block_size) == tail
    # the full blocks and the tail are the tokens; a tail is one more block
    assert full * block_size + tail == tokens
    assert blocks_for(tokens, block_size) == full + (1 if tail else 0)


@pytest.mark.parametrize(
    ("prompt", "n", "blocks"),
    # block size 4: P + 1 tokens for token 0's slot, then one block per choice past the first
    [(2, 1, 1), (3, 1, 1), (4, 1, 2), (7, 1, 2), (8, 1, 3), (3, 4, 4), (4, 4, 5), (5, 3, 4)],
)  # fmt: skip
def test_fork_blocks(prompt: int, n: int, blocks: int) -> None:
    assert fork_blocks(prompt, n, 4) == blocks


def test_resume_blocks_count_generated_tokens_and_the_next_slot() -> None:
    assert resume_blocks(5, 2, 4) == 2  # 8 tokens: two full blocks
    assert resume_blocks(5, 3, 4) == 3  # 9 tokens
    assert resume_blocks(0, 0, 4) == 1


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="choices must be at least 1"):
        fork_blocks(4, 0, 4)
    with pytest.raises(ValueError, match="block_size >= 1"):
        blocks_for(4, 0)
    with pytest.raises(ValueError, match="num_tokens >= 0"):
        blocks_for(-1, 4)
    for f in (full_blocks, tail_tokens):
        with pytest.raises(ValueError, match="block_size >= 1"):
            f(4, 0)
        with pytest.raises(ValueError, match="num_tokens >= 0"):
            f(-1, 4)
