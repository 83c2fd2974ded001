"""A disk tier under the host tier: what the host tier would drop goes to a file instead.

Long sessions (coding agents carry tens of thousands of tokens over many turns) outgrow the
host tier. With a disk tier the radix cache's tier is :class:`SpillingTier`: one pool of
*tier blocks* (``host + disk`` of them), each of which lives either in a host-memory slot (a
:class:`HostTier`) or in a slot of a file. Demotions always write to host memory; when host
memory is full, its least recently written blocks are spilled to the file first. A load reads
each block from wherever it is. The radix tree sees one tier (its LRU over tiered leaves, its
prefetches, its drops when the whole tier is full) and never where a block lies.

On disk a slot holds one block as the cache file of ``cache_store.py`` holds a node's KV:
K then V, each ``[layers, block_size, kv_heads, head_dim]`` in the KV dtype, so a slot is
``bytes_per_block`` bytes at ``slot * bytes_per_block``. The file is unlinked once opened
(nothing is left after a crash; persistence across restarts is ``cache_store.py``'s).

Threads: loads may run on the prefetch copy thread while the engine thread demotes. The
bookkeeping is under a lock; blocks being read are *pinned* (not spilled meanwhile), and the
copies themselves run outside the lock.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.host_tier import HostTier
from radixlang.runtime.kv_cache import KVCache


class _TierPool(BlockPool):
    """The tier's block pool, telling its store which blocks became free."""

    def __init__(self, num_blocks: int, block_size: int, store: SpillingTier) -> None:
        super().__init__(num_blocks, block_size)
        self._store = store

    def decref(self, blocks: Iterable[int]) -> list[int]:
        freed = super().decref(blocks)
        if freed:
            self._store.release(freed)
        return freed


class SpillingTier:
    """A host tier of ``host_blocks`` slots over a file of ``disk_blocks`` slots (a
    ``TierStore`` for the radix cache)."""

    def __init__(
        self,
        kv: KVCache,
        host_blocks: int,
        disk_blocks: int,
        folder: str | Path | None = None,
    ) -> None:
        if disk_blocks < 1:
            raise ValueError(f"the disk tier needs at least one block, got {disk_blocks}")
        self.kv = kv
        self.ram = HostTier(kv, host_blocks, folder)
        self.pool = _TierPool(host_blocks + disk_blocks, kv.block_size, self)
        self.bytes_per_block = self.ram.bytes_per_block
        self.disk_blocks = disk_blocks
        folder = Path(folder) if folder is not None else Path(tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="radixlang-disk-tier-", suffix=".kv", dir=folder)
        os.unlink(name)  # the descriptor keeps the file; nothing is left after a crash
        os.ftruncate(fd, disk_blocks * self.bytes_per_block)  # sparse until written
        self._fd = fd
        self.path = folder
        self._lock = threading.Lock()
        self._ram_slot: dict[int, int] = {}  # tier block -> host slot
        self._disk_slot: dict[int, int] = {}  # tier block -> file slot
        self._disk_free = list(range(disk_blocks - 1, -1, -1))
        self._in_ram: OrderedDict[int, None] = OrderedDict()  # spill order: oldest first
        self._pinned: dict[int, int] = {}  # tier blocks being read -> readers
        self.spilled_blocks = self.disk_read_blocks = 0
        self.spill_seconds = self.disk_read_seconds = 0.0
        # Stand-ins for HostTier's counters, over both levels (the cache's load-time estimate).
        self.blocks_written = self.blocks_read = 0
        self.write_seconds = self.read_seconds = 0.0

    @property
    def device(self) -> torch.device:
        return self.ram.device

    # ---- the TierStore protocol --------------------------------------------------------------
    def write(self, device_blocks: Sequence[int], host_blocks: Sequence[int]) -> None:
        """Copy device blocks into tier blocks (to host memory, spilling older blocks)."""
        if not device_blocks:
            return
        start = time.perf_counter()
        room = self.ram.pool.num_blocks
        with self._lock:  # in pieces the host can hold: a piece may spill the one before
            for i in range(0, len(host_blocks), room):
                piece, sources = host_blocks[i : i + room], device_blocks[i : i + room]
                # Host blocks a load is reading cannot be spilled: what does not fit goes
                # straight to the file.
                fits = self.ram.pool.num_free + sum(b not in self._pinned for b in self._in_ram)
                slots = self._ram_slots(min(len(piece), fits))
                for block, slot in zip(piece, slots, strict=False):
                    self._ram_slot[block] = slot
                    self._in_ram[block] = None
                self.ram.write(sources[: len(slots)], slots)
                direct = list(zip(sources[len(slots) :], piece[len(slots) :], strict=True))
                if direct:
                    disk = [self._disk_free.pop() for _ in direct]
                    self._write_disk(
                        self.kv.k,
                        self.kv.v,
                        [(d, s) for (d, _), s in zip(direct, disk, strict=True)],
                    )
                    for (_, block), slot in zip(direct, disk, strict=True):
                        self._disk_slot[block] = slot
        self.blocks_written += len(host_blocks)
        self.write_seconds += time.perf_counter() - start

    def read(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Copy tier blocks into device blocks, from wherever each one is."""
        if not host_blocks:
            return
        start = time.perf_counter()
        with self._lock:
            for b in host_blocks:
                self._pinned[b] = self._pinned.get(b, 0) + 1
            ram = [(self._ram_slot[b], d) for b, d in zip(host_blocks, device_blocks, strict=True)
                   if b in self._ram_slot]  # fmt: skip
            disk = [(self._disk_slot[b], d)
                    for b, d in zip(host_blocks, device_blocks, strict=True)
                    if b not in self._ram_slot]  # fmt: skip
        try:
            if ram:
                self.ram.read([s for s, _ in ram], [d for _, d in ram])
            if disk:
                t0 = time.perf_counter()
                self._read_disk(disk)
                self.disk_read_blocks += len(disk)
                self.disk_read_seconds += time.perf_counter() - t0
        finally:
            with self._lock:
                for b in host_blocks:
                    left = self._pinned[b] - 1
                    if left:
                        self._pinned[b] = left
                    else:
                        del self._pinned[b]
        self.blocks_read += len(host_blocks)
        self.read_seconds += time.perf_counter() - start

    def release(self, blocks: Sequence[int]) -> None:
        """Tier blocks became free: give back their slots."""
        with self._lock:
            ram = []
            for b in blocks:
                slot = self._ram_slot.pop(b, None)
                if slot is not None:
                    self._in_ram.pop(b, None)
                    ram.append(slot)
                else:
                    self._disk_free.append(self._disk_slot.pop(b))
            if ram:
                self.ram.pool.decref(ram)

    def gather(self, blocks: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tier ``blocks``, ``[layers, len(blocks), block, heads, dim]`` each, from
        wherever they are (to save them)."""
        kv = self.kv
        dims = (kv.shape.num_layers, len(blocks), kv.block_size, kv.shape.kv_heads)
        k = torch.empty((*dims, kv.shape.head_dim), dtype=kv.dtype)
        v = torch.empty_like(k)
        shape = (2, *dims[:1], kv.block_size, kv.shape.kv_heads, kv.shape.head_dim)
        buffer = torch.empty(self.bytes_per_block, dtype=torch.uint8)
        block = buffer.view(kv.dtype).view(shape)
        with self._lock:  # the engine thread saves; a prefetch may read meanwhile (no writes)
            for i, b in enumerate(blocks):
                slot = self._ram_slot.get(b)
                if slot is not None:
                    k[:, i].copy_(self.ram.k[:, slot])
                    v[:, i].copy_(self.ram.v[:, slot])
                    continue
                os.preadv(self._fd, [memoryview(buffer.numpy())],
                          self._disk_slot[b] * self.bytes_per_block)  # fmt: skip
                k[:, i].copy_(block[0])
                v[:, i].copy_(block[1])
        return k, v

    # ---- spilling ------------------------------------------------------------------------
    def _ram_slots(self, n: int) -> list[int]:
        """``n`` free host slots, spilling the oldest unpinned blocks to disk for room (the
        caller made sure enough are unpinned)."""
        short = n - self.ram.pool.num_free
        if short > 0:
            victims = [b for b in self._in_ram if b not in self._pinned][:short]
            t0 = time.perf_counter()
            slots = [self._disk_free.pop() for _ in victims]
            pairs = [(self._ram_slot[b], s) for b, s in zip(victims, slots, strict=True)]
            self._write_disk(self.ram.k, self.ram.v, pairs)
            freed = []
            for b, s in zip(victims, slots, strict=True):
                freed.append(self._ram_slot.pop(b))
                del self._in_ram[b]
                self._disk_slot[b] = s
            self.ram.pool.decref(freed)
            self.spilled_blocks += len(victims)
            self.spill_seconds += time.perf_counter() - t0
        return self.ram.pool.alloc(n)

    def _block_bytes(self, k: torch.Tensor, v: torch.Tensor, slot: int) -> memoryview:
        kv = torch.stack((k[:, slot], v[:, slot]))  # K then V, [layers, block, heads, dim]
        return memoryview(kv.contiguous().cpu().view(torch.uint8).numpy())

    def _write_disk(
        self, k: torch.Tensor, v: torch.Tensor, pairs: Sequence[tuple[int, int]]
    ) -> None:
        """Block of ``k``/``v`` (host slots, or device blocks) -> file slot, for each pair."""
        for source, disk_slot in pairs:
            data = self._block_bytes(k, v, source)
            os.pwrite(self._fd, data, disk_slot * self.bytes_per_block)

    def _read_disk(self, pairs: Sequence[tuple[int, int]]) -> None:
        """File slot -> device block, for each pair."""
        shape = (2, self.kv.shape.num_layers, self.kv.block_size, self.kv.shape.kv_heads,
                 self.kv.shape.head_dim)  # fmt: skip
        buffer = torch.empty(self.bytes_per_block, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        block = buffer.view(self.kv.dtype).view(shape)
        for disk_slot, device_block in pairs:
            got = os.preadv(self._fd, [view], disk_slot * self.bytes_per_block)
            if got != self.bytes_per_block:
                raise OSError(f"short read from the disk tier: {got} of {self.bytes_per_block}")
            self.kv.k[:, device_block].copy_(block[0])
            self.kv.v[:, device_block].copy_(block[1])

    # ---- reports ---------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            on_disk = len(self._disk_slot)
        return self.ram.stats() | {
            "disk_blocks_total": self.disk_blocks,
            "disk_blocks_used": on_disk,
            "disk_bytes_total": self.disk_blocks * self.bytes_per_block,
            "disk_spilled_blocks_total": self.spilled_blocks,
            "disk_read_blocks_total": self.disk_read_blocks,
            "disk_spill_ms": round(self.spill_seconds * 1e3, 3),
            "disk_read_ms": round(self.disk_read_seconds * 1e3, 3),
        }

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
