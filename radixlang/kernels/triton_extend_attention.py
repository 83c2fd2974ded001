"""Triton extend (prefill after a cached prefix) attention over the paged KV cache.

One program per (sequence, query head, block of ``BLOCK_M`` new tokens). Phase 1 walks the
sequence's cached prefix through its block table (every prefix token is visible, so no causal
mask); phase 2 walks the sequence's new tokens in ``k_new``/``v_new``, which are packed back to
back like ``q``, with the causal mask (new token ``i`` sees new tokens ``0..i``). Both phases
share one float32 online softmax. The prefix tiles are the padded-block tiles of
``paged_attention``, so block sizes that are not powers of two work by masking.

With a sliding window (``window=W``: the token at position p sees ``p - W + 1 .. p``) both
phases start at the first key the program's earliest query sees and mask per row; prefix blocks
before that are never read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from radixlang.kernels.layout import PagedKV, check_paged_kv
from radixlang.kernels.triton_decode_attention import (
    LOG2E,
    MIN_DOT,
    attend_paged_tiles,
    check_int_tensor,
    check_same_device,
    dim_pad,
    dot_precision,
    mm,
    tile_geometry,
    tile_rows,
    upcast_dots,
)


@triton.jit
def _extend_kernel(
    q_ptr,
    k_new_ptr,
    v_new_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    starts_ptr,
    out_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_tb,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    extend_len = tl.load(extend_lens_ptr + seq)
    if m_block * BLOCK_M >= extend_len:
        return  # the grid covers the longest sequence; shorter ones need fewer blocks
    prefix_len = tl.load(prefix_lens_ptr + seq)
    start = tl.load(starts_ptr + seq).to(tl.int64)
    kv_head = head // GROUP

    m_idx = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m_idx < extend_len
    d = tl.arange(0, DIM_PAD)
    dim_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + (start + m_idx)[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
        mask=m_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Base-2 online softmax: scores are pre-multiplied by log2(e) (folded into qk_scale).
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)

    # Phase 1: the cached prefix, all of it visible to every new token (without a window).
    table_row = table_ptr + seq.to(tl.int64) * stride_tb
    prefix_blocks = (prefix_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    first_block = 0
    new_first = 0  # the first new token any row of this program sees
    row_first = prefix_len + m_idx - window + 1  # each row's first visible position
    if WINDOWED:
        first_block = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0) // BLOCK_SIZE
        new_first = tl.maximum(m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = attend_paged_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, first_block, prefix_blocks,
        prefix_len, row_first, kv_head, qk_scale, d, dim_ok, KV_HEADS, HEAD_DIM, BLOCK_SIZE,
        BLOCK_PAD, BLOCKS_PER_TILE, UPCAST, PRECISION, WINDOWED,
    )  # fmt: skip

    # Phase 2: the new tokens, causally; keys past this block's last query are never visible.
    new_end = tl.minimum(extend_len, (m_block + 1) * BLOCK_M)
    for n_first in range(new_first, new_end, BLOCK_N):
        n_idx = n_first + tl.arange(0, BLOCK_N)
        n_ok = n_idx < extend_len
        rows = start + n_idx
        k_t = tl.load(
            k_new_ptr + rows[None, :] * stride_kt + kv_head * stride_kh + d[:, None] * stride_kd,
            mask=n_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        s = mm(q, k_t, UPCAST, PRECISION) * qk_scale
        visible = n_ok[None, :] & (n_idx[None, :] <= m_idx[:, None])
        if WINDOWED:
            visible = visible & (n_idx[None, :] > m_idx[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOWED:
            # A row may see none of a tile, nor anything before it: no -inf - -inf.
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        # (Without a window every row sees new token 0, so none is ever fully masked.)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_new_ptr + rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :] * stride_vd,
            mask=n_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new

    if WINDOWED:  # rows past the sequence's end may see nothing (they are not stored)
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (start + m_idx)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & dim_ok[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    *,
    block_m: int | None = None,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """New tokens attend to their cached prefix and causally to each other (Triton path); with
    a ``window``, to the last ``window`` positions up to their own only.

    Same contract as ``reference.extend_attention``: ``q`` ``[tokens, heads, dim]`` and
    ``k_new``/``v_new`` ``[tokens, kv_heads, dim]`` pack the sequences' new tokens back to
    back, ``extend_lens[i]`` for sequence ``i``, whose first ``prefix_lens[i]`` tokens are read
    from ``cache`` through ``block_tables[i]``. ``block_m`` (a power of two >= 16) is the number
    of query rows per program; by default the K/V tile's row count (64, or 32 for wide rows).
    Reads the length tensors on the host once.
    """
    check_paged_kv(cache)
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim]; got {tuple(t.shape)}")
    check_int_tensor("block_tables", block_tables, 2)
    check_int_tensor("prefix_lens", prefix_lens, 1)
    check_int_tensor("extend_lens", extend_lens, 1)
    check_same_device(
        q=q,
        k_new=k_new,
        v_new=v_new,
        k_cache=cache.k,
        block_tables=block_tables,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
    )
    tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = cache.k.shape
    if k_new.shape != (tokens, kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(
            f"k_new and v_new must be [{tokens}, {kv_heads}, {head_dim}]; "
            f"got {tuple(k_new.shape)} and {tuple(v_new.shape)}"
        )
    if head_dim != cache_dim:
        raise ValueError(f"q head_dim {head_dim} does not match the cache's {cache_dim}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if not (q.dtype == k_new.dtype == v_new.dtype == cache.k.dtype):
        raise ValueError(
            f"q, k_new, v_new and the cache must share a dtype; got {q.dtype}, {k_new.dtype}, "
            f"{v_new.dtype} and {cache.k.dtype}"
        )
    batch = block_tables.shape[0]
    if prefix_lens.shape[0] != batch or extend_lens.shape[0] != batch:
        raise ValueError(
            f"prefix_lens ({prefix_lens.shape[0]}) and extend_lens ({extend_lens.shape[0]}) "
            f"must both have one entry per block-table row ({batch})"
        )
    d_pad = dim_pad(head_dim)
    # Query rows and new-token key rows per tile: the usual flash-attention tile.
    block_n = tile_rows(q.dtype, d_pad)
    block_m = block_n if block_m is None else block_m
    if block_m < MIN_DOT or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {MIN_DOT}; got {block_m}")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive; got {window}")
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    # The lengths as ints: from the caller when it has them (no device sync), else read back.
    if host_lens is None:
        prefix, extend = prefix_lens.tolist(), extend_lens.tolist()
    else:
        prefix, extend = list(host_lens[0]), list(host_lens[1])
    if sum(extend) != tokens:
        raise ValueError(f"extend_lens sum to {sum(extend)} but q holds {tokens} tokens")
    capacity = block_tables.shape[1] * block_size
    if batch and (min(prefix) < 0 or min(extend) < 0):
        raise ValueError("prefix_lens and extend_lens must be non-negative")
    if any(p + e > capacity for p, e in zip(prefix, extend, strict=True)):
        raise ValueError(f"a sequence exceeds its block table's capacity of {capacity} tokens")
    if tokens == 0:
        return out
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    # Where each sequence's new tokens start in the packed tensors (exclusive prefix sum).
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    block_pad, blocks_per_tile = tile_geometry(block_size, block_n)

    grid = (batch, heads, math.ceil(max(extend) / block_m))
    _extend_kernel[grid](
        q,
        k_new,
        v_new,
        cache.k,
        cache.v,
        block_tables,
        prefix_lens.contiguous(),
        extend_lens.contiguous(),
        starts,
        out,
        scale * LOG2E,
        window or 0,
        *q.stride(),
        *k_new.stride(),
        *v_new.stride(),
        *out.stride()[:2],
        block_tables.stride(0),
        GROUP=heads // kv_heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_PAD=block_pad,
        BLOCKS_PER_TILE=blocks_per_tile,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        UPCAST=upcast_dots(q),
        PRECISION=dot_precision(q),
        WINDOWED=window is not None,
        # head_dim 128 in 16-bit: 8 warps keep the [64, 128] float32 accumulator in registers.
        num_warps=8 if block_m * d_pad >= 64 * 128 else 4,
        num_stages=2,
    )
    return out
