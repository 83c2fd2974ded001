"""Triton decode attention over the paged KV cache: split-KV (flash-decoding) in two stages.

Stage 1 runs one program per (sequence, KV head, KV partition). The program owns every query
head of its GQA group, so each K/V tile is read once per group: the group's query rows form a
``[GROUP_PAD, DIM_PAD]`` tile multiplied against the K/V tile with ``tl.dot``. It walks the
block-table entries of its partition a tile at a time with an online softmax in float32 and
writes a normalised partial output plus its log-sum-exp. Stage 2 runs one program per
(sequence, query head) and merges that sequence's non-empty partitions. When every sequence fits
in one partition, stage 1 writes the final output itself and stage 2 is skipped.

K/V tiles are ``BLOCKS_PER_TILE`` cache blocks, each padded to ``BLOCK_PAD`` (a power of two)
rows; padding rows are masked, which is how block sizes such as 5 or 3 work. The same tile
helpers serve the cached prefix in ``extend_attention``.

A sliding window (``window=W``: the token at position p sees ``p - W + 1 .. p``) starts each
sequence's walk at the block holding its window's first token: partitions and blocks before it
are never read, and the reduce skips their partitions.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixlang.kernels.layout import PagedKV, check_paged_kv

# Tokens per KV partition before rounding down to whole blocks: long enough that the merge is
# cheap, short enough that a small batch still yields many programs.
DEFAULT_PARTITION_TOKENS = 256
# Rows of a K/V tile (a whole number of padded blocks); tl.dot needs every dimension >= 16.
# Wide rows (over 256 bytes: head_dim 256 in 16-bit, 128 in float32) take half, to stay within
# shared memory and registers.
TILE_ROWS = 64
WIDE_TILE_ROWS = 32
MIN_DOT = 16
# Partitions merged per step of the reduce loop.
REDUCE_PARTS = 16
LOG2E = 1.4426950408889634


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tile_geometry(block_size: int, tile_rows: int = TILE_ROWS) -> tuple[int, int]:
    """``(BLOCK_PAD, BLOCKS_PER_TILE)`` for a K/V tile of about ``tile_rows`` rows."""
    block_pad = next_pow2(block_size)
    # At least MIN_DOT rows so the tile is a legal tl.dot operand even for tiny blocks.
    blocks = max(1, max(tile_rows, MIN_DOT) // block_pad)
    return block_pad, blocks


def dim_pad(head_dim: int) -> int:
    return max(MIN_DOT, next_pow2(head_dim))


def tile_rows(dtype: torch.dtype, d_pad: int) -> int:
    """Rows per K/V (and query) tile for rows of ``d_pad`` elements of ``dtype``."""
    return WIDE_TILE_ROWS if d_pad * dtype.itemsize > 256 else TILE_ROWS


def upcast_dots(t: torch.Tensor) -> bool:
    """Whether tl.dot operands must be cast to float32 first.

    CPU tensors mean the Triton interpreter, whose tl.dot multiplies bfloat16 operands as their
    raw uint16 bit patterns (triton 3.9); float32 operands are exact there. GPUs keep the
    narrow dtype for the tensor cores.
    """
    return t.device.type != "cuda"


def dot_precision(t: torch.Tensor) -> str:
    """tl.dot ``input_precision`` for operands of ``t``'s dtype and device.

    float32 on a GPU uses 3xTF32: tensor cores at close to float32 accuracy, where "ieee" would
    fall back to scalar FMAs that spill heavily, and plain TF32 would lose ~3 digits. The
    setting means nothing for 16-bit operands or under the interpreter.
    """
    if t.device.type == "cuda" and t.dtype == torch.float32:
        return "tf32x3"
    return "ieee" if t.device.type != "cuda" else "tf32"


def check_int_tensor(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s); got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor; got {t.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device; got {devices}")


@triton.jit
def mm(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in float32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def paged_tile_slots(
    table_row_ptr,
    tile_first_block,
    end_block,
    seq_len,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
):
    """Cache slots of one tile's rows and which rows hold a token of the sequence.

    Row ``r`` is offset ``r % BLOCK_PAD`` of block ``tile_first_block + r // BLOCK_PAD``;
    rows past the block size, past ``end_block`` or past ``seq_len`` are invalid, and table
    entries from ``end_block`` on are never loaded.
    """
    rows = tl.arange(0, BLOCKS_PER_TILE * BLOCK_PAD)
    block = tile_first_block + rows // BLOCK_PAD
    offset = rows % BLOCK_PAD
    in_table = block < end_block
    valid = in_table & (offset < BLOCK_SIZE) & (block * BLOCK_SIZE + offset < seq_len)
    block_id = tl.load(table_row_ptr + block, mask=in_table, other=0).to(tl.int64)
    return block_id * BLOCK_SIZE + offset, valid


@triton.jit
def attend_paged_tiles(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    first_block,
    end_block,
    seq_len,
    row_first,
    kv_head,
    qk_scale,
    d,
    dim_ok,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    """Fold blocks ``first_block .. end_block`` of a sequence into a base-2 online softmax.

    ``q`` is a ``[rows, DIM_PAD]`` tile whose scores are all visible (no causal mask) or, when
    ``WINDOWED``, visible from position ``row_first[row]`` on (a row may then see none of a
    tile); the running max ``m_i``, sum ``l_i`` and output ``acc`` come back updated.
    """
    kv_base = kv_head * HEAD_DIM
    SLOT_STRIDE: tl.constexpr = KV_HEADS * HEAD_DIM
    for tile_first in range(first_block, end_block, BLOCKS_PER_TILE):
        slots, valid = paged_tile_slots(
            table_row_ptr, tile_first, end_block, seq_len, BLOCK_SIZE, BLOCK_PAD, BLOCKS_PER_TILE
        )
        k_t = tl.load(
            k_cache_ptr + slots[None, :] * SLOT_STRIDE + kv_base + d[:, None],
            mask=valid[None, :] & dim_ok[:, None],
            other=0.0,
        )
        s = mm(q, k_t, UPCAST, PRECISION) * qk_scale
        if WINDOWED:
            r = tl.arange(0, BLOCKS_PER_TILE * BLOCK_PAD)
            pos = (tile_first + r // BLOCK_PAD) * BLOCK_SIZE + r % BLOCK_PAD
            s = tl.where(valid[None, :] & (pos[None, :] >= row_first[:, None]), s, float("-inf"))
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOWED:
            # A row that has seen nothing yet keeps max -inf: shift by 0 instead (no inf - inf).
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + slots[:, None] * SLOT_STRIDE + kv_base + d[None, :],
            mask=valid[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, UPCAST, PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    max_blocks,
    window,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    PARTITION_BLOCKS: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Capped at the table's width so that a bad length cannot read past the row.
    seq_blocks = tl.minimum((seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE, max_blocks)
    first_block = part * PARTITION_BLOCKS
    end_block = tl.minimum(first_block + PARTITION_BLOCKS, seq_blocks)
    seq_first = 0  # the first visible position
    if WINDOWED:
        seq_first = tl.maximum(seq_len - window, 0)
        first_block = tl.maximum(first_block, seq_first // BLOCK_SIZE)
    if not DIRECT and end_block <= first_block:
        return  # a short sequence leaves its later partitions empty; the reduce skips them

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    table_row = table_ptr + seq.to(tl.int64) * stride_tb

    # Base-2 online softmax: scores are pre-multiplied by log2(e) (folded into qk_scale).
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    row_first = tl.zeros([GROUP_PAD], tl.int32) + seq_first
    m_i, l_i, acc = attend_paged_tiles(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, first_block, end_block,
        seq_len, row_first, kv_head, qk_scale, d, dim_ok, KV_HEADS, HEAD_DIM, BLOCK_SIZE,
        BLOCK_PAD, BLOCKS_PER_TILE, UPCAST, PRECISION, WINDOWED,
    )  # fmt: skip

    store_mask = head_ok[:, None] & dim_ok[None, :]
    if DIRECT:
        # l_i is 0 only for an empty sequence, whose output is defined as zeros.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        row = seq.to(tl.int64) * stride_pb + heads * stride_ph + part * stride_pp
        tl.store(part_out_ptr + row[:, None] + d[None, :], acc / l_i[:, None], mask=store_mask)
        lse_at = seq.to(tl.int64) * stride_lb + heads * stride_lh + part
        tl.store(part_lse_ptr + lse_at, m_i + tl.log2(l_i), mask=head_ok)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    max_blocks,
    window,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_BLOCKS: tl.constexpr,
    PARTS: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Only the partitions stage 1 filled (as it counts them); others hold garbage.
    seq_blocks = tl.minimum((seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE, max_blocks)
    num_parts = (seq_blocks + PARTITION_BLOCKS - 1) // PARTITION_BLOCKS
    first_part = 0
    if WINDOWED:  # those wholly before the window are empty; the first step holds a real one
        first_part = tl.maximum(seq_len - window, 0) // BLOCK_SIZE // PARTITION_BLOCKS
    d = tl.arange(0, DIM_PAD)
    dim_ok = d < HEAD_DIM
    part_row = part_out_ptr + seq.to(tl.int64) * stride_pb + head * stride_ph
    lse_row = part_lse_ptr + seq.to(tl.int64) * stride_lb + head * stride_lh

    m = float("-inf")
    total = 0.0
    acc = tl.zeros([DIM_PAD], tl.float32)
    for first in range(first_part, num_parts, PARTS):
        parts = first + tl.arange(0, PARTS)
        part_ok = parts < num_parts
        lse = tl.load(lse_row + parts, mask=part_ok, other=float("-inf"))
        o = tl.load(
            part_row + parts[:, None] * stride_pp + d[None, :],
            mask=part_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    # total is 0 only for a zero-length sequence, whose output is defined as zeros.
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def decode_attention(
    q: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    partition_tokens: int = DEFAULT_PARTITION_TOKENS,
    window: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """One query token per sequence over its ``seq_lens[i]`` cached tokens, the last ``window``
    of them only when a window is given (Triton path).

    Same contract as ``reference.decode_attention``: ``q`` ``[batch, heads, head_dim]``, the
    new token's K/V already stored, query head ``h`` reads KV head ``h // (heads // kv_heads)``.
    ``partition_tokens`` is rounded down to whole blocks (at least one) per KV partition.

    The grid is sized from the block tables' width, so on a GPU nothing is read back to the
    host (no sync; the call can be captured in a CUDA graph) and ``seq_lens`` is not checked
    there: a length past the table's capacity is capped at it. CPU ``seq_lens`` are checked.
    A zero-length sequence gets zeros.

    The partitions are fixed spans of the sequence, never sized by the batch. ``deterministic``
    also merges them one at a time in order: the reduce otherwise sums a group of partitions
    whose size follows the batch's widest table, and a sum's order may follow its width.
    """
    check_paged_kv(cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim]; got shape {tuple(q.shape)}")
    check_int_tensor("block_tables", block_tables, 2)
    check_int_tensor("seq_lens", seq_lens, 1)
    check_same_device(q=q, k_cache=cache.k, block_tables=block_tables, seq_lens=seq_lens)
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, cache_dim = cache.k.shape
    if head_dim != cache_dim:
        raise ValueError(f"q head_dim {head_dim} does not match the cache's {cache_dim}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if q.dtype != cache.k.dtype:
        raise ValueError(f"q dtype {q.dtype} does not match the cache dtype {cache.k.dtype}")
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables rows ({block_tables.shape[0]}) and seq_lens ({seq_lens.shape[0]}) "
            f"must both equal the batch ({batch})"
        )
    if partition_tokens < 1:
        raise ValueError(f"partition_tokens must be positive; got {partition_tokens}")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive; got {window}")
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    if not seq_lens.is_cuda:  # free to check when it costs no device sync
        lens = seq_lens.tolist()
        if min(lens) < 0 or max(lens) > capacity:
            raise ValueError(f"seq_lens must lie in [0, {capacity}] (the block tables' capacity)")
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()

    group = heads // kv_heads
    partition_blocks = max(1, partition_tokens // block_size)
    num_parts = max(1, math.ceil(max_blocks / partition_blocks))
    d_pad = dim_pad(head_dim)
    block_pad, blocks_per_tile = tile_geometry(block_size, tile_rows(q.dtype, d_pad))
    # A tile never needs more blocks than a partition has (but keeps >= MIN_DOT rows).
    blocks_per_tile = max(
        min(blocks_per_tile, next_pow2(partition_blocks)), math.ceil(MIN_DOT / block_pad)
    )
    direct = num_parts == 1
    if direct:
        part_out = out  # unused placeholders: stage 1 writes the output itself
        part_lse = out
        p_strides = (0, 0, 0)
        l_strides = (0, 0)
    else:
        part_out = torch.empty(
            (batch, heads, num_parts, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((batch, heads, num_parts), dtype=torch.float32, device=q.device)
        p_strides = part_out.stride()[:3]
        l_strides = part_lse.stride()[:2]

    _decode_partition_kernel[(batch, kv_heads, num_parts)](
        q,
        cache.k,
        cache.v,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        max_blocks,
        window or 0,
        *q.stride(),
        block_tables.stride(0),
        *out.stride()[:2],
        *p_strides,
        *l_strides,
        GROUP=group,
        GROUP_PAD=max(MIN_DOT, next_pow2(group)),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_PAD=block_pad,
        BLOCKS_PER_TILE=blocks_per_tile,
        PARTITION_BLOCKS=partition_blocks,
        DIRECT=direct,
        UPCAST=upcast_dots(q),
        PRECISION=dot_precision(q),
        WINDOWED=window is not None,
        num_warps=4,
    )
    if direct:
        return out
    _decode_reduce_kernel[(batch, heads)](
        part_out,
        part_lse,
        seq_lens,
        out,
        max_blocks,
        window or 0,
        *p_strides,
        *l_strides,
        *out.stride()[:2],
        HEAD_DIM=head_dim,
        DIM_PAD=d_pad,
        BLOCK_SIZE=block_size,
        PARTITION_BLOCKS=partition_blocks,
        PARTS=1 if deterministic else min(REDUCE_PARTS, next_pow2(num_parts)),
        WINDOWED=window is not None,
        num_warps=4,
    )
    return out
