"""KV storage: every layer's K and V blocks, sized from a memory budget.

One tensor holds K for all layers, ``[layers, num_blocks, block_size, kv_heads, head_dim]``
(and one holds V), so that a layer's slice is a contiguous ``PagedKV`` for the kernels and a
copy-on-write copies a block's slots in every layer with one indexing op.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixlang.kernels.layout import PagedKV


@dataclass(frozen=True)
class KVShape:
    """The per-token shape of a model's KV cache."""

    num_layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.kv_heads * self.head_dim * itemsize


class KVCache:
    """The block storage of all layers; block ids are those of the runtime's ``BlockPool``."""

    def __init__(
        self,
        shape: KVShape,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1; got {num_blocks}, {block_size}")
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        dims = (shape.num_layers, num_blocks, block_size, shape.kv_heads, shape.head_dim)
        # Zeros, not empty: padded reads of never-written slots must stay finite.
        self.k = _zeros(dims, dtype, torch.device(device))
        self.v = _zeros(dims, dtype, torch.device(device))
        self.layers = [PagedKV(self.k[i], self.v[i]) for i in range(shape.num_layers)]

    @classmethod
    def from_budget(
        cls,
        shape: KVShape,
        budget_bytes: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        """As many blocks as ``budget_bytes`` holds (at least one, or a clear error)."""
        per_block = shape.bytes_per_block(block_size, dtype)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no block "
                f"({per_block} bytes per {block_size}-token block)"
            )
        return cls(shape, int(num_blocks), block_size, dtype, device)

    @property
    def num_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def copy_block(self, src: int, dst: int, num_slots: int) -> None:
        """Copy the first ``num_slots`` slots of block ``src`` into ``dst`` in every layer.

        This is the ``BlockPool`` copy-on-write hook.
        """
        self.k[:, dst, :num_slots] = self.k[:, src, :num_slots]
        self.v[:, dst, :num_slots] = self.v[:, src, :num_slots]

    def describe(self) -> dict[str, object]:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes": self.num_bytes,
            "bytes_per_token": self.shape.bytes_per_block(1, self.dtype),
        }


def _zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU its pages are mapped lazily: ``torch.zeros`` writes every
    byte of a multi-GiB pool up front (seconds, and all of it resident at once), where numpy's
    calloc-backed zeros take fresh zero pages from the kernel as blocks are first written."""
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(dims, dtype={1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize])
    return torch.from_numpy(raw).view(dtype)  # all-zero bits are 0.0 in every float dtype


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device``: CUDA's free bytes, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def default_kv_budget(device: torch.device) -> int:
    """A KV budget: 85% of free GPU memory, or 20% of the host's available memory (≤ 8 GiB).

    Call it after the weights are loaded, so that they are not counted as free.
    """
    free = available_memory_bytes(device)
    if device.type == "cuda":
        return int(free * 0.85)
    return min(int(free * 0.2), 8 << 30)
