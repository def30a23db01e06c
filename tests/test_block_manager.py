"""Block allocator and prefix cache: exact block ids, reference counts, LRU eviction."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pdserve.engine.block_manager import BlockManager, NoFreeBlocks, hash_block


@dataclass
class Seq:
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_committed_blocks: int = 0
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids


def run(bm: BlockManager, seq: Seq) -> None:
    """Admit a sequence with its prefix hits, compute its whole prompt, commit its blocks."""
    hits = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, len(seq.token_ids) - len(hits) * bm.block_size, hits)
    seq.num_computed_tokens = len(seq.token_ids)
    bm.cache_full_blocks(seq)


def test_hash_is_chained_and_stable() -> None:
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])


def test_allocation_takes_lowest_free_ids_and_frees_all() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = Seq(list(range(10))), Seq(list(range(100, 105)))
    run(bm, a)
    run(bm, b)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3, 4]
    assert bm.num_used_blocks == 5 and bm.num_free_blocks == 3
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_used_blocks == 0
    # full blocks of both prompts stay cached: a's [0, 1], b's [3]
    assert bm.num_cached_blocks == 3


def test_prefix_hit_shares_blocks_by_id() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Seq([*list(range(12)), 50])  # 3 full blocks + 1 partial
    run(bm, a)
    assert a.block_table == [0, 1, 2, 3]
    b = Seq([*list(range(8)), 70, 71, 72, 73, 74])  # shares the first two blocks
    run(bm, b)
    assert b.block_table == [0, 1, 4, 5]
    assert b.num_computed_tokens == 13
    assert bm.ref_counts[:6] == [2, 2, 1, 1, 1, 1]
    bm.free_seq(a)
    assert bm.ref_counts[:6] == [1, 1, 0, 0, 1, 1]
    bm.free_seq(b)
    assert bm.num_used_blocks == 0


def test_last_token_is_never_a_hit() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    run(bm, Seq(prompt))
    again = Seq(list(prompt))
    # only the first block may be reused: the last token's logits must be computed
    assert bm.find_cached_prefix(again) == [0]


def test_hit_on_freed_cached_block_revives_it() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Seq(list(range(9)))
    run(bm, a)
    bm.free_seq(a)
    assert bm.num_free_blocks == 4
    b = Seq(list(range(9)))
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate(b, 1, hits)
    assert b.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 1


def test_lru_eviction_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = Seq([1, 2, 3]), Seq([4, 5, 6])
    run(bm, a)  # blocks 0 (cached [1,2]) and 1 (partial)
    run(bm, b)  # blocks 2 (cached [4,5]) and 3 (partial)
    bm.free_seq(a)
    bm.free_seq(b)
    # partial blocks are evicted first, then cached blocks least recently freed first
    assert list(bm.free) == [3, 1, 0, 2]
    c = Seq([9, 9, 9, 9, 9])
    run(bm, c)
    assert c.block_table == [3, 1, 0]
    assert bm.find_cached_prefix(Seq([1, 2, 3])) == []  # block 0 was evicted
    assert bm.find_cached_prefix(Seq([4, 5, 6])) == [2]  # block 2 survives


def test_never_used_blocks_go_between_freed_and_cached_ones() -> None:
    """A cache of ten million blocks holds no entry per block until one is handed out; the
    order stays: freed partial blocks first, then never-used ones by id, then cached ones."""
    bm = BlockManager(num_blocks=10_000_000, block_size=2)
    assert bm.num_free_blocks == 10_000_000 and 9_999_999 in bm.free
    a, b = Seq([1, 2, 3]), Seq([4, 5, 6])
    run(bm, a)  # blocks 0 (cached [1,2]) and 1 (partial)
    run(bm, b)  # blocks 2 (cached [4,5]) and 3 (partial)
    bm.free_seq(a)
    bm.free_seq(b)
    order = iter(bm.free)
    assert [next(order) for _ in range(4)] == [3, 1, 4, 5]
    assert bm.num_free_blocks == 10_000_000 and 0 in bm.free and 4 in bm.free
    c = Seq(list(range(100, 109)))  # five blocks: the two partial ones, then never-used 4..6
    run(bm, c)
    assert c.block_table == [3, 1, 4, 5, 6]
    assert bm.find_cached_prefix(Seq([1, 2, 3])) == [0]  # cached blocks are taken last
    with pytest.raises(RuntimeError, match="never handed out"):
        bm.free.remove(7)


def test_allocate_fails_without_side_effects() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = Seq(list(range(12)))
    assert not bm.allocate(a, 12)
    assert a.block_table == [] and bm.num_free_blocks == 2
    with pytest.raises(NoFreeBlocks):
        bm.allocate_blocks(3)


def test_double_free_is_an_error() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    ids = bm.allocate_blocks(1)
    bm.free_blocks(ids)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free_blocks(ids)


def test_prefix_caching_off() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run(bm, Seq(list(range(9))))
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_prefix(Seq(list(range(9)))) == []
