"""A fixed pool of KV-cache blocks: a free list, reference counts and copy-on-write.

A block id is an int in ``[0, num_blocks)``. Every holder of a block (a radix-tree node, a
running request) owns one reference; a block returns to the free list when its last reference
is dropped. The pool never touches KV data itself: copy-on-write calls a hook that the KV
storage installs, so this module stays free of tensors.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

# copy_hook(src_block, dst_block, num_slots): copy the first num_slots token slots of src to dst.
CopyHook = Callable[[int, int, int], None]

DEFAULT_BLOCK_SIZE = 16


class OutOfBlocksError(RuntimeError):
    """The pool cannot satisfy an allocation; nothing was allocated."""

    def __init__(self, requested: int, free: int, total: int) -> None:
        super().__init__(
            f"out of KV blocks: requested {requested}, {free} free of {total} "
            f"(evict cached prefixes or admit fewer requests)"
        )
        self.requested = requested
        self.free = free
        self.total = total


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many ``block_size``-token blocks hold ``num_tokens`` token slots."""
    return -(-num_tokens // block_size)


# A request's block-table entry for a block it has released: under a sliding window, blocks
# wholly before every future query's window. The entry keeps the table's indices aligned with
# positions; it holds no reference and the kernels never read it.
RELEASED = -1


def dead_blocks(num_computed: int, window: int, block_size: int) -> int:
    """How many leading blocks no query from position ``num_computed`` on can see.

    The token at position p sees positions ``p - window + 1 .. p`` (transformers' Mistral
    mask), so the next query's window starts at ``num_computed - window + 1``; a block is dead
    once it ends at or before that.
    """
    return max(0, num_computed - window + 1) // block_size


class BlockPoolError(RuntimeError):
    """A caller broke the reference-counting contract (double free, use after free, bad id)."""


class IntegrityError(AssertionError):
    """An internal invariant of the pool or the cache does not hold."""


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` token slots each, handed out by reference."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        copy_hook: CopyHook | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.copy_hook = copy_hook
        self._refcount = [0] * num_blocks
        # A stack: the most recently freed block is reused first (its memory is warm).
        self._free = list(range(num_blocks - 1, -1, -1))

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """How many blocks hold ``num_tokens`` token slots."""
        return blocks_for(num_tokens, self.block_size)

    # ---- allocation and references -------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with one reference; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free), self.num_blocks)
        if n == 0:
            return []
        blocks = self._free[-n:]
        del self._free[-n:]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each block; every block must already be held."""
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b)
            if self._refcount[b] == 0:
                raise BlockPoolError(f"incref of free block {b} (use after free)")
        for b in blocks:
            self._refcount[b] += 1

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free."""
        blocks = list(blocks)
        need = Counter(blocks)
        for b, k in need.items():
            self._check_id(b)
            if self._refcount[b] < k:
                raise BlockPoolError(
                    f"decref of block {b} {k} time(s) but it has {self._refcount[b]} "
                    f"reference(s) (double free)"
                )
        freed = []
        for b in blocks:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                freed.append(b)
        self._free.extend(freed)
        return freed

    def copy_on_write(self, block: int, num_slots: int) -> int:
        """Make ``block`` writable for a caller that holds one reference to it.

        A block only the caller holds is returned as it is. A shared block is copied (its first
        ``num_slots`` slots, through the copy hook) into a fresh block that replaces the caller's
        reference; the original and its other holders are left untouched.
        """
        self._check_id(block)
        if self._refcount[block] == 0:
            raise BlockPoolError(f"copy-on-write of free block {block}")
        if not 0 <= num_slots <= self.block_size:
            raise ValueError(f"num_slots must be in [0, {self.block_size}], got {num_slots}")
        if self._refcount[block] == 1:
            return block
        (new_block,) = self.alloc(1)
        if self.copy_hook is not None and num_slots > 0:
            try:
                self.copy_hook(block, new_block, num_slots)
            except BaseException:
                self.decref([new_block])
                raise
        self._refcount[block] -= 1  # stays >= 1: it was shared
        return new_block

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Free list and reference counts agree; with ``expected_refs``, every count is exact.

        ``expected_refs`` maps block id to the number of holders the caller knows of; blocks it
        does not name must be free.
        """
        free = self._free
        free_set = set(free)
        if len(free_set) != len(free):
            dup = [b for b, k in Counter(free).items() if k > 1]
            raise IntegrityError(f"blocks on the free list twice: {dup[:10]}")
        for b in free:
            if not 0 <= b < self.num_blocks:
                raise IntegrityError(f"free list holds out-of-range block {b}")
            if self._refcount[b] != 0:
                raise IntegrityError(f"free block {b} has refcount {self._refcount[b]}")
        negative = [b for b, r in enumerate(self._refcount) if r < 0]
        if negative:
            raise IntegrityError(f"blocks with negative refcounts: {negative[:10]}")
        held = sum(1 for r in self._refcount if r > 0)
        if held + len(free) != self.num_blocks:
            lost = [b for b, r in enumerate(self._refcount) if r == 0 and b not in free_set]
            raise IntegrityError(f"blocks neither free nor held (leaked): {lost[:10]}")
        if expected_refs is not None:
            for b in range(self.num_blocks):
                want = expected_refs.get(b, 0)
                if self._refcount[b] != want:
                    raise IntegrityError(
                        f"block {b} has refcount {self._refcount[b]} but {want} holder(s)"
                    )

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise BlockPoolError(f"block id {block} out of range [0, {self.num_blocks})")
