import pytest
from kv_sim import SlotStore

from radixlang.runtime.block_pool import (
    BlockPool,
    BlockPoolError,
    IntegrityError,
    OutOfBlocksError,
)


def test_alloc_gives_distinct_blocks_with_one_reference():
    pool = BlockPool(8, block_size=4)
    blocks = pool.alloc(5)
    assert len(set(blocks)) == 5
    assert all(pool.refcount(b) == 1 for b in blocks)
    assert pool.num_free == 3 and pool.num_used == 5
    pool.check_integrity({b: 1 for b in blocks})


def test_alloc_zero_and_negative():
    pool = BlockPool(2)
    assert pool.alloc(0) == []
    with pytest.raises(ValueError):
        pool.alloc(-1)


def test_exhaustion_raises_without_allocating_anything():
    pool = BlockPool(4)
    held = pool.alloc(3)
    with pytest.raises(OutOfBlocksError) as info:
        pool.alloc(2)
    assert info.value.requested == 2 and info.value.free == 1 and info.value.total == 4
    assert "requested 2, 1 free of 4" in str(info.value)
    assert pool.num_free == 1
    pool.check_integrity({b: 1 for b in held})
    (last,) = pool.alloc(1)
    assert last not in held


def test_decref_frees_at_zero_and_reports_freed_blocks():
    pool = BlockPool(4)
    a, b = pool.alloc(2)
    pool.incref([a])
    assert pool.decref([a, b]) == [b]
    assert pool.refcount(a) == 1 and pool.refcount(b) == 0
    assert pool.decref([a]) == [a]
    assert pool.num_free == 4
    pool.check_integrity({})


def test_double_free_and_use_after_free_are_refused():
    pool = BlockPool(4)
    (a,) = pool.alloc(1)
    pool.decref([a])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.decref([a])
    with pytest.raises(BlockPoolError, match="use after free"):
        pool.incref([a])
    (b,) = pool.alloc(1)
    # Dropping the same block twice in one call when it has one reference is also refused,
    # and nothing is changed.
    with pytest.raises(BlockPoolError):
        pool.decref([b, b])
    assert pool.refcount(b) == 1
    pool.check_integrity({b: 1})


def test_out_of_range_ids_are_refused():
    pool = BlockPool(4)
    with pytest.raises(BlockPoolError, match="out of range"):
        pool.incref([4])
    with pytest.raises(BlockPoolError, match="out of range"):
        pool.refcount(-1)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockPool(0)
    with pytest.raises(ValueError):
        BlockPool(4, block_size=0)


def test_copy_on_write_of_exclusive_block_returns_it():
    store = SlotStore(4, 4)
    pool = BlockPool(4, block_size=4, copy_hook=store.copy)
    (a,) = pool.alloc(1)
    assert pool.copy_on_write(a, 3) == a
    assert store.copies == []


def test_copy_on_write_leaves_the_original_intact():
    store = SlotStore(4, 4)
    pool = BlockPool(4, block_size=4, copy_hook=store.copy)
    (a,) = pool.alloc(1)
    store.slots[a][:3] = ["k0", "k1", "k2"]
    pool.incref([a])  # a second holder
    b = pool.copy_on_write(a, 3)
    assert b != a
    assert store.copies == [(a, b, 3)]
    assert store.slots[b][:3] == ["k0", "k1", "k2"]
    store.slots[b][3] = "new"  # the writer appends into its copy
    store.slots[b][0] = "overwritten"
    assert store.slots[a] == ["k0", "k1", "k2", None]
    assert pool.refcount(a) == 1 and pool.refcount(b) == 1
    pool.check_integrity({a: 1, b: 1})


def test_copy_on_write_when_pool_is_full_changes_nothing():
    pool = BlockPool(2, block_size=4)
    a, b = pool.alloc(2)
    pool.incref([a])
    with pytest.raises(OutOfBlocksError):
        pool.copy_on_write(a, 2)
    pool.check_integrity({a: 2, b: 1})


def test_copy_on_write_hook_failure_returns_the_new_block():
    def failing_hook(src: int, dst: int, n: int) -> None:
        raise RuntimeError("device error")

    pool = BlockPool(3, block_size=4, copy_hook=failing_hook)
    (a,) = pool.alloc(1)
    pool.incref([a])
    with pytest.raises(RuntimeError, match="device error"):
        pool.copy_on_write(a, 1)
    pool.check_integrity({a: 2})


def test_copy_on_write_argument_checks():
    pool = BlockPool(2, block_size=4)
    (a,) = pool.alloc(1)
    with pytest.raises(ValueError):
        pool.copy_on_write(a, 5)
    pool.decref([a])
    with pytest.raises(BlockPoolError):
        pool.copy_on_write(a, 1)


def test_check_integrity_detects_corruption():
    pool = BlockPool(4)
    a, b = pool.alloc(2)
    with pytest.raises(IntegrityError, match="refcount 1 but 2"):
        pool.check_integrity({a: 2, b: 1})
    with pytest.raises(IntegrityError, match="refcount 1 but 0"):
        pool.check_integrity({a: 1})
    pool._free.append(a)  # corrupt: a held block on the free list
    with pytest.raises(IntegrityError, match="free block"):
        pool.check_integrity()
    pool._free.pop()
    pool._refcount[a] = 0  # corrupt: a block neither free nor held
    with pytest.raises(IntegrityError, match="leaked"):
        pool.check_integrity()


def test_blocks_for_tokens():
    pool = BlockPool(4, block_size=16)
    assert [pool.blocks_for_tokens(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
