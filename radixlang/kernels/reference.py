"""Torch paths of the paged-KV kernels, for CPUs (and as the GPU fallback).

Every function is vectorised over tokens: decode runs the whole batch as a few batched matmuls
over the gathered blocks; extend loops over sequences (not tokens) and hands each one to
``scaled_dot_product_attention`` with its cached prefix in front.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlang.kernels.layout import PagedKV


def store_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, cache: PagedKV) -> None:
    """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into ``cache`` at ``slot_mapping``."""
    _, _, kv_heads, head_dim = cache.k.shape
    slots = slot_mapping.to(torch.long)
    cache.k.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(cache.k.dtype))
    cache.v.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(cache.v.dtype))


def gather_sequence_kv(
    cache: PagedKV, block_tables: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each row's first ``max_len`` tokens: ``[batch, padded_len, kv_heads, dim]``.

    Whole blocks are gathered, so ``padded_len`` is ``max_len`` rounded up to a block; positions
    past a row's own length hold whatever its padding blocks hold and must be masked.
    """
    num_blocks = -(-max_len // cache.block_size)
    rows = block_tables[:, :num_blocks].reshape(-1).to(torch.long)
    return _gather_blocks(cache, rows, block_tables.shape[0], num_blocks)


def _gather_blocks(
    cache: PagedKV, rows: torch.Tensor, batch: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (batch, num_blocks * cache.block_size, cache.kv_heads, cache.head_dim)
    # index_select copies whole blocks (memcpy per row); advanced indexing is 3-7x slower here.
    k = torch.index_select(cache.k, 0, rows).view(shape)
    v = torch.index_select(cache.v, 0, rows).view(shape)
    return k, v


# Decode attention runs in sub-batches whose gathered K and V fit in about this many bytes, so
# that attention reads them from cache right after the gather. A whole-batch gather spills to
# memory: at batch 64 with 450-token contexts in float32 a step took 3.8x as long.
DECODE_CHUNK_BYTES = 6 * 2**20


@dataclass(frozen=True)
class DecodePlan:
    """What every layer's decode attention over one batch shares; built once per forward."""

    rows: torch.Tensor  # the blocks to gather, row after row, long
    num_blocks: int  # blocks gathered per sequence
    visible: torch.Tensor  # [batch, num_blocks * block_size] bool: slot holds a visible token
    additive_mask: torch.Tensor  # the same as 0 / -inf in the cache's dtype, [batch, 1, 1, len]


def plan_decode(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cache: PagedKV, window: int | None = None
) -> DecodePlan:
    """The gather rows and mask of a decode batch.

    With a ``window`` each row sees its last ``window`` tokens only, and only the blocks that
    hold them are gathered: entries before them (blocks a request has released) are never read.
    """
    lens = seq_lens.to(torch.long)
    bs = cache.block_size
    if window is None:
        num_blocks = -(-int(lens.max()) // bs)
        rows = block_tables[:, :num_blocks].reshape(-1).to(torch.long)
        slots = torch.arange(num_blocks * bs, device=lens.device)
        visible = slots[None, :] < lens[:, None]
    else:
        first = (lens - window).clamp(min=0)  # each row's first visible position
        first_block = first // bs
        num_blocks = int(((lens - 1) // bs - first_block).max()) + 1
        index = first_block[:, None] + torch.arange(num_blocks, device=lens.device)
        # Rows that need fewer blocks read their last entry again, masked.
        index = index.clamp(max=block_tables.shape[1] - 1)
        rows = block_tables.to(torch.long).gather(1, index).reshape(-1)
        slots = first_block[:, None] * bs + torch.arange(num_blocks * bs, device=lens.device)
        visible = (slots < lens[:, None]) & (slots >= first[:, None])
    additive = torch.zeros(visible.shape, dtype=cache.k.dtype, device=lens.device)
    additive.masked_fill_(~visible, float("-inf"))
    return DecodePlan(rows, num_blocks, visible, additive[:, None, None, :])


def decode_attention(
    q: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over its ``seq_lens[i]`` cached tokens (the last
    ``window`` of them under a sliding window).

    ``q`` is ``[batch, heads, head_dim]``; the new token's own K/V must already be stored.
    Grouped-query attention: query head ``h`` reads KV head ``h // (heads // kv_heads)``.
    ``plan`` (from ``plan_decode``, with the same window) saves recomputing the batch's gather
    rows and mask per layer.
    """
    if plan is None:
        plan = plan_decode(block_tables, seq_lens, cache, window)
    batch = q.shape[0]
    per_sequence = 2 * plan.num_blocks * cache.block_size * cache.kv_heads * cache.head_dim
    step = max(1, DECODE_CHUNK_BYTES // (per_sequence * cache.k.element_size()))
    if batch <= step:
        return _decode_chunk(q, cache, plan, 0, batch, scale)
    out = torch.empty_like(q)
    for start in range(0, batch, step):
        end = min(start + step, batch)
        out[start:end] = _decode_chunk(q[start:end], cache, plan, start, end, scale)
    return out


def _decode_chunk(
    q: torch.Tensor, cache: PagedKV, plan: DecodePlan, start: int, end: int, scale: float
) -> torch.Tensor:
    """Decode attention for the plan's sequences ``start:end`` (``q`` holds just those)."""
    batch, heads, head_dim = q.shape
    n = plan.num_blocks
    k, v = _gather_blocks(cache, plan.rows[start * n : end * n], batch, n)
    # A cache kept in another dtype than the model's (say bfloat16 under float32) is read in
    # the queries' dtype.
    k, v = k.to(q.dtype), v.to(q.dtype)
    if q.dtype != torch.float32 and batch >= 16:
        return _block_diagonal_decode(q, k, v, plan.visible[start:end], scale)
    # A GQA group's query heads act as that KV head's query *positions* (none causal), so
    # torch's CPU flash attention reads each KV head once per group, straight from the
    # gathered [batch, len, kv_heads, dim] layout seen as [batch, kv_heads, len, dim].
    kv_heads = cache.kv_heads
    out = F.scaled_dot_product_attention(
        q.reshape(batch, kv_heads, heads // kv_heads, head_dim),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=plan.additive_mask[start:end].to(q.dtype),
        scale=scale,
    )
    return out.reshape(batch, heads, head_dim)


def _block_diagonal_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention as two batched matmuls: for 16-bit dtypes at larger batches, where it
    measured faster than CPU SDPA.

    The gathered K/V stay in their stored ``[batch, len, kv_heads * dim]`` layout (permuting
    them would copy every byte again) and the queries are made block-diagonal instead: query
    head h holds its vector in KV head ``h // group``'s columns and zeros elsewhere. One batched
    matmul then scores every head against its own KV head; the extra products are on zeros and
    cost far less than the copy they avoid.
    """
    batch, heads, head_dim = q.shape
    padded_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    k = k.view(batch, padded_len, kv_heads * head_dim)
    v = v.view(batch, padded_len, kv_heads * head_dim)
    diagonal = torch.arange(kv_heads, device=q.device)
    q_blocks = q.new_zeros(batch, kv_heads, group, kv_heads, head_dim)
    q_blocks[:, diagonal, :, diagonal, :] = q.view(batch, kv_heads, group, head_dim).transpose(0, 1)
    q_blocks = q_blocks.view(batch, heads, kv_heads * head_dim)
    scores = torch.bmm(q_blocks, k.transpose(1, 2)).float() * scale  # [batch, heads, len]
    scores.masked_fill_(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    mixed = torch.bmm(probs, v).view(batch, kv_heads, group, kv_heads, head_dim)
    # Keep each head's own KV head's columns: the diagonal blocks.
    out = mixed[:, diagonal, :, diagonal, :].transpose(0, 1)
    return out.reshape(batch, heads, head_dim)


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    scale: float,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """New tokens attend to their sequence's cached prefix and causally to each other.

    ``q`` ``[tokens, heads, dim]`` and ``k_new``/``v_new`` ``[tokens, kv_heads, dim]`` hold the
    sequences' new tokens packed back to back, ``extend_lens[i]`` of them for sequence ``i``,
    whose first ``prefix_lens[i]`` tokens are read from ``cache`` through ``block_tables[i]``.
    With a ``window``, the token at position p sees positions ``p - window + 1 .. p`` only, and
    the prefix blocks before the first new token's window are never read.
    """
    out = torch.empty_like(q)
    start = 0
    if host_lens is None:
        host_lens = (prefix_lens.tolist(), extend_lens.tolist())
    for row, (prefix, length) in enumerate(zip(*host_lens, strict=True)):
        end = start + length
        if length == 0:
            continue
        ki, vi = k_new[start:end], v_new[start:end]
        mask = None
        # The first cached position any new token sees.
        first = 0 if window is None else max(0, prefix - window + 1)
        if prefix > first:
            b0 = first // cache.block_size
            table = block_tables[row : row + 1, b0:]
            kp, vp = gather_sequence_kv(cache, table, prefix - b0 * cache.block_size)
            lo, hi = first - b0 * cache.block_size, prefix - b0 * cache.block_size
            ki = torch.cat([kp[0, lo:hi].to(ki.dtype), ki])
            vi = torch.cat([vp[0, lo:hi].to(vi.dtype), vi])
        keys = prefix - first + length  # keys[t] is position first + t
        if window is not None and prefix + length > window:
            query_pos = torch.arange(prefix, prefix + length, device=q.device)[:, None]
            key_pos = torch.arange(first, prefix + length, device=q.device)[None, :]
            mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        elif keys > length:
            # Every new token sees the whole prefix, and the new tokens up to itself.
            mask = torch.ones(length, keys, dtype=torch.bool, device=q.device)
            mask[:, keys - length :] = torch.ones(length, length, device=q.device).tril().bool()
        # 4-d [1, heads, length, dim] views: CPU flash attention takes nothing else (3-d inputs
        # fall back to the unfused math path, about 2x slower at 512 tokens).
        attn = F.scaled_dot_product_attention(
            q[None, start:end].transpose(1, 2),
            ki[None].transpose(1, 2),
            vi[None].transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )[0]
        out[start:end] = attn.transpose(0, 1)
        start = end
    return out


# ---- deterministic attention: every query on its own -------------------------------------------


@dataclass(frozen=True)
class QueryPlan:
    """Attention computed query by query (deterministic inference): per query its row of block
    table, how many cached tokens it sees and the first of them it sees.

    A query's result is then a function of its own inputs only: the same whether it is a
    decode or a token of an extend, alone or in any batch. The torch path computes each query
    with tensors of exactly its own sizes; the Triton path runs its decode kernel over the
    queries as if each were a sequence of its own.
    """

    block_tables: torch.Tensor  # [queries, width] int32: each query's row
    seq_lens: torch.Tensor  # [queries] int32, on the tables' device
    lens: list[int]  # the same as host ints
    starts: list[int]  # each query's first visible position (0 without a window)


def plan_queries(
    block_tables: torch.Tensor,
    rows: Sequence[int] | None,
    lens: Sequence[int],
    window: int | None = None,
) -> QueryPlan:
    """Query i reads ``block_tables[rows[i]]`` (row i when ``rows`` is None) and sees its
    first ``lens[i]`` tokens (the last ``window`` of them only)."""
    device = block_tables.device
    tables = block_tables.to(torch.int32)
    if rows is not None:
        tables = tables.index_select(0, torch.tensor(list(rows), dtype=torch.long, device=device))
    lens = [int(n) for n in lens]
    starts = [0 if window is None else max(0, n - window) for n in lens]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return QueryPlan(tables.contiguous(), seq_lens, lens, starts)


def plan_extend_queries(
    block_tables: torch.Tensor,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    window: int | None = None,
) -> QueryPlan:
    """An extend's tokens as queries: sequence i's j-th new token sees ``prefix_lens[i] + j + 1``
    tokens (its own K/V must be stored before attention runs)."""
    rows: list[int] = []
    lens: list[int] = []
    for row, (prefix, n) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        rows += [row] * n
        lens += range(prefix + 1, prefix + n + 1)
    return plan_queries(block_tables, rows, lens, window)


def query_attention(q: torch.Tensor, cache: PagedKV, plan: QueryPlan, scale: float) -> torch.Tensor:
    """Each query of ``q`` ``[queries, heads, dim]`` over its own visible tokens, one at a time,
    in float32; the same operations on tensors of the same sizes for the same query wherever
    it comes from."""
    queries, heads, dim = q.shape
    kv_heads, bs = cache.kv_heads, cache.block_size
    group = heads // kv_heads
    out = torch.empty_like(q)
    for i in range(queries):
        length, start = plan.lens[i], plan.starts[i]
        if length <= start:
            out[i] = 0
            continue
        b0, b1 = start // bs, -(-length // bs)
        blocks = plan.block_tables[i, b0:b1].to(torch.long)
        lo, hi = start - b0 * bs, length - b0 * bs
        k = cache.k.index_select(0, blocks).view(-1, kv_heads, dim)[lo:hi]
        v = cache.v.index_select(0, blocks).view(-1, kv_heads, dim)[lo:hi]
        k = k.float().permute(1, 2, 0).contiguous()  # [kv_heads, dim, n]
        v = v.float().transpose(0, 1).contiguous()  # [kv_heads, n, dim]
        qi = q[i].float().reshape(kv_heads, group, dim).contiguous()
        probs = torch.softmax(torch.bmm(qi, k) * scale, dim=-1)
        out[i] = torch.bmm(probs, v).reshape(heads, dim).to(q.dtype)
    return out
