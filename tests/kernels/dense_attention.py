"""A naive dense attention reference and random paged inputs, for the kernel tests.

Reads the cache one slot at a time and computes each sequence with plain matmuls, so that it
shares no code with either kernel path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from radixlang.kernels.layout import PagedKV


@dataclass
class PagedCase:
    """Random sequences stored in a shuffled block pool."""

    cache: PagedKV
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded with 0
    seq_lens: list[int]
    k: list[torch.Tensor]  # per sequence, [len, kv_heads, dim], as stored
    v: list[torch.Tensor]


def make_paged_case(
    seq_lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedCase:
    """Store random K/V for each sequence into blocks drawn in random order from a pool."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = PagedKV(
        torch.randn(shape, generator=gen).to(dtype).to(device),
        torch.randn(shape, generator=gen).to(dtype).to(device),
    )
    tables = torch.zeros(len(seq_lens), max([*per_seq, 1]), dtype=torch.int32)
    ks, vs = [], []
    for row, (n, nb) in enumerate(zip(seq_lens, per_seq, strict=True)):
        blocks = [order.pop() for _ in range(nb)]
        tables[row, :nb] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype).to(device)
        for pos in range(n):
            cache.k[blocks[pos // block_size], pos % block_size] = k[pos]
            cache.v[blocks[pos // block_size], pos % block_size] = v[pos]
        ks.append(k)
        vs.append(v)
    return PagedCase(cache, tables.to(device), list(seq_lens), ks, vs)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """``q`` ``[n, heads, dim]`` at absolute ``query_positions`` over ``k``/``v`` ``[len, kvh, d]``.

    Query ``i`` sees keys ``0..query_positions[i]``, or with a sliding ``window`` only keys
    ``query_positions[i] - window + 1 ..`` of them (transformers' Mistral mask); computed in
    float64.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(query_positions):
        first = 0 if window is None else max(0, pos - window + 1)
        for h in range(heads):
            keys = k[first : pos + 1, h // group].double()
            values = v[first : pos + 1, h // group].double()
            weights = torch.softmax(keys @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ values
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
