"""Block arithmetic: how many KV blocks a request holds. One module for every caller (the
engine's allocator and hand-off, the decode worker, the coordinator's reservations and
capacity check), so that the numbers a coordinator asks for are the ones a worker takes.

A prompt of P tokens and n choices, block size B (every figure rounds up)::

    prompt           ceil(P / B)                 the prompt's KV (what a transfer fills)
    fork             ceil((P + 1) / B) + n - 1   + token 0's slot, + one block per choice past
                                                 the first (its copy of the partial last block,
                                                 or its token 0's block when P + 1 fills whole)
    resume           ceil((P + G + 1) / B)       a choice recomputed after G generated tokens
    whole request    ceil((P + max_tokens) / B)  what it can ever hold (the capacity check)

A block is full when every one of its B slots holds a token; a fork shares the full blocks of
the prompt and copies the partial one after them (its tail), if there is one::

    P = 10, B = 4:   [t0..t3] [t4..t7] [t8 t9 . .]    full_blocks 2, tail_tokens 2
    P = 8,  B = 4:   [t0..t3] [t4..t7]                full_blocks 2, tail_tokens 0
"""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks the KV of ``num_tokens`` tokens fills (the last one maybe partly)."""
    _check(num_tokens, block_size)
    return -(-num_tokens // block_size)


def full_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks the KV of ``num_tokens`` tokens fills whole (the leading ones: shareable, and
    what a prefix cache holds)."""
    _check(num_tokens, block_size)
    return num_tokens // block_size


def tail_tokens(num_tokens: int, block_size: int) -> int:
    """Tokens in the partial block after the full ones: 0 when there is none."""
    _check(num_tokens, block_size)
    return num_tokens % block_size


def fork_blocks(num_prompt_tokens: int, n: int, block_size: int) -> int:
    """Blocks ``n`` choices of one prompt start with on the worker that decodes them: the
    prompt's and token 0's slot for the first, one more for each of the others."""
    if n < 1:
        raise ValueError(f"choices must be at least 1, got {n}")
    return blocks_for(num_prompt_tokens + 1, block_size) + n - 1


def resume_blocks(num_prompt_tokens: int, num_generated: int, block_size: int) -> int:
    """Blocks a choice resumed on another worker starts with: the prompt, the tokens it had
    generated, and the slot of its next token."""
    return blocks_for(num_prompt_tokens + num_generated + 1, block_size)


def _check(num_tokens: int, block_size: int) -> None:
    if block_size < 1 or num_tokens < 0:
        raise ValueError(
            f"need block_size >= 1 and num_tokens >= 0, got {block_size}, {num_tokens}"
        )
