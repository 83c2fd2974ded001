"""The paged KV layout every kernel reads and writes.

One layer's cache is a pair of tensors ``[num_blocks, block_size, kv_heads, head_dim]`` (K and
V). A token's *slot* is ``block * block_size + offset``. A sequence's *block table* row lists its
blocks in order; entries past its last block are padding and are never read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PagedKV(NamedTuple):
    """One layer's K and V block storage."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]


def check_paged_kv(cache: PagedKV) -> None:
    """Refuse a cache whose K and V disagree or are not contiguous (slots are flat views)."""
    if cache.k.dim() != 4 or cache.k.shape != cache.v.shape:
        raise ValueError(
            f"K and V caches must both be [num_blocks, block_size, kv_heads, head_dim]; "
            f"got {tuple(cache.k.shape)} and {tuple(cache.v.shape)}"
        )
    if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        raise ValueError("K and V caches must be contiguous")
