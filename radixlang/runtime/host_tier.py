"""The radix cache's second tier: KV blocks in host memory, where evicted prefixes go.

The radix cache copies an evicted node's blocks here instead of dropping them, and copies them
back into fresh device blocks when a match reaches them (``radix_tier.TierStore``). The blocks
have the device pool's shape and layout, with their own free list and reference counts (a
``BlockPool``): a tier block holds what its device block held, slot for slot.

Where the bytes live. With the KV pool on a GPU the tier is pinned host memory. With the pool
in CPU memory, a tier that fits in half the host's available memory is plain memory, faulted in
when the tier is made (about 0.3 s per GiB): a page faulted in by a demotion's copy costs several
times more (measured: 0.7 ms per 368 KiB block on first write, 0.04 ms after). A larger one is a
file mapped into memory (``torch.from_file(shared=True)``) under a cache folder: the kernel pages
it out to disk under pressure and back in on access, so the tier can be larger than what the
process keeps resident, at a price: a first write to each page faults it in from the file
system and dirty pages are written back to disk (measured: demotions 3-4x slower than into
plain memory). The file is unlinked as soon as it is mapped: nothing is left behind after a
crash (persistence across restarts is ``cache_store.py``'s job, not this file's).

On the CPU, copies go run by run: blocks consecutive on both sides are one slice copy across all
layers, without ``index_select``'s intermediate tensor (3x faster on scattered blocks).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.kv_cache import KVCache, available_memory_bytes

# A CPU tier of at most this share of the host's available memory is plain memory, not a file.
IN_MEMORY_SHARE = 0.5
# madvise(2): fault a range in, writable, without touching its bytes (Linux 5.14+).
MADV_POPULATE_WRITE = 23


class HostTier:
    """``num_blocks`` host blocks shaped like ``kv``'s; a ``TierStore`` for the radix cache."""

    def __init__(self, kv: KVCache, num_blocks: int, folder: str | Path | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.kv = kv
        self.pool = BlockPool(num_blocks, kv.block_size)
        dims = (kv.shape.num_layers, num_blocks, kv.block_size, kv.shape.kv_heads)
        dims += (kv.shape.head_dim,)
        self.device = kv.k.device
        self.bytes_per_block = kv.shape.bytes_per_block(kv.block_size, kv.dtype)
        tier_bytes = num_blocks * self.bytes_per_block
        if self.device.type == "cuda":
            self.storage = "pinned host memory"
            self.k = torch.zeros(dims, dtype=kv.dtype, pin_memory=True)
            self.v = torch.zeros(dims, dtype=kv.dtype, pin_memory=True)
        elif tier_bytes <= IN_MEMORY_SHARE * available_memory_bytes(self.device):
            self.storage = "host memory"
            self.k = _populated_zeros(dims, kv.dtype)
            self.v = _populated_zeros(dims, kv.dtype)
        else:
            self.storage = "mapped file"
            self.k, self.v = _mapped_pair(dims, kv.dtype, folder)
        # Copy traffic, to weigh the copies against the computing they save.
        self.blocks_written = self.blocks_read = 0
        self.write_seconds = self.read_seconds = 0.0

    @classmethod
    def from_budget(
        cls, kv: KVCache, budget_bytes: int, folder: str | Path | None = None
    ) -> HostTier:
        """As many blocks as ``budget_bytes`` holds (at least one, or a clear error)."""
        per_block = kv.shape.bytes_per_block(kv.block_size, kv.dtype)
        if budget_bytes < per_block:
            raise ValueError(
                f"a host tier of {budget_bytes} bytes holds no KV block ({per_block} bytes each)"
            )
        return cls(kv, budget_bytes // per_block, folder)

    def write(self, device_blocks: Sequence[int], host_blocks: Sequence[int]) -> None:
        """Copy device blocks into host blocks, pairwise, in every layer."""
        if not device_blocks:
            return
        start = time.perf_counter()
        if self.device.type == "cpu":
            _copy_runs(((self.k, self.kv.k), (self.v, self.kv.v)), device_blocks, host_blocks)
        else:
            src = torch.tensor(list(device_blocks), device=self.device)
            dst = torch.tensor(list(host_blocks))
            for host, device in ((self.k, self.kv.k), (self.v, self.kv.v)):
                host.index_copy_(1, dst, device.index_select(1, src).cpu())
        self.blocks_written += len(host_blocks)
        self.write_seconds += time.perf_counter() - start

    def read(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Copy host blocks into device blocks, pairwise, in every layer."""
        if not host_blocks:
            return
        start = time.perf_counter()
        if self.device.type == "cpu":
            _copy_runs(((self.kv.k, self.k), (self.kv.v, self.v)), host_blocks, device_blocks)
        else:
            src = torch.tensor(list(host_blocks))
            dst = torch.tensor(list(device_blocks), device=self.device)
            for host, device in ((self.k, self.kv.k), (self.v, self.kv.v)):
                rows = host.index_select(1, src)
                device.index_copy_(1, dst, rows.to(self.device, non_blocking=True))
        self.blocks_read += len(host_blocks)
        self.read_seconds += time.perf_counter() - start

    def gather(self, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tier ``blocks``, ``[layers, len(blocks), block, heads, dim]`` each (to
        save them)."""
        idx = torch.tensor(list(blocks), dtype=torch.long)
        return self.k.index_select(1, idx), self.v.index_select(1, idx)

    def stats(self) -> dict[str, int | str]:
        used = self.pool.num_used
        return {
            "blocks_total": self.pool.num_blocks,
            "blocks_used": used,
            "bytes_total": self.pool.num_blocks * self.bytes_per_block,
            "bytes_used": used * self.bytes_per_block,
            "storage": self.storage,
            "blocks_written": self.blocks_written,
            "blocks_read": self.blocks_read,
            "write_ms": round(self.write_seconds * 1e3, 3),
            "read_ms": round(self.read_seconds * 1e3, 3),
        }


def _copy_runs(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
) -> None:
    """Copy block ``src_blocks[i]`` of each pair's second tensor into block ``dst_blocks[i]``
    of its first (blocks on dimension 1), one slice copy per run of blocks consecutive on
    both sides."""
    n, i = len(src_blocks), 0
    while i < n:
        s0, d0, j = src_blocks[i], dst_blocks[i], i + 1
        while j < n and src_blocks[j] == s0 + (j - i) and dst_blocks[j] == d0 + (j - i):
            j += 1
        for dst, src in pairs:
            dst[:, d0 : d0 + j - i].copy_(src[:, s0 : s0 + j - i])
        i = j


def _populated_zeros(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages are all faulted in now (lazily, where the kernel
    cannot populate a range up front)."""
    size = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, size)  # anonymous: zero pages
    with contextlib.suppress(OSError, ValueError):  # an older kernel: first writes fault them
        memory.madvise(MADV_POPULATE_WRITE)
    return torch.frombuffer(memory, dtype=dtype).view(dims)  # the tensor keeps the mapping


def _mapped_pair(
    dims: tuple[int, ...], dtype: torch.dtype, folder: str | Path | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V tensors backed by one shared file mapping, unlinked once mapped."""
    numel = math.prod(dims)
    folder = Path(folder) if folder is not None else Path(tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="radixlang-tier-", suffix=".kv", dir=folder)
    os.close(fd)
    try:
        flat = torch.from_file(name, shared=True, size=2 * numel, dtype=dtype)
    finally:
        os.unlink(name)  # the mapping keeps the pages; the name is not needed
    return flat[:numel].view(dims), flat[numel:].view(dims)
