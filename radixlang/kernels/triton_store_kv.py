"""Triton kernel writing new tokens' K/V into the paged cache at their slots.

One program per token copies that token's ``[kv_heads, head_dim]`` K and V rows (any strides,
so the K/V views of a fused QKV projection need no copy) into the contiguous cache at
``slot * kv_heads * head_dim``, casting to the cache dtype on the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlang.kernels.layout import PagedKV, check_paged_kv
from radixlang.kernels.triton_decode_attention import check_int_tensor, check_same_device, next_pow2


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    # A slot outside the cache is dropped rather than written out of bounds. (Folded into a
    # head count: the interpreter mishandles a block mask and-ed with a scalar condition.)
    heads = tl.where((slot >= 0) & (slot < num_slots), KV_HEADS, 0)
    mask = (h < heads)[:, None] & (d < HEAD_DIM)[None, :]
    dst = slot * (KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]
    k = tl.load(
        k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask
    )
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(
        v_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask
    )
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, cache: PagedKV) -> None:
    """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into ``cache`` at ``slot_mapping``.

    Same contract as ``reference.store_kv``; ``slot_mapping`` may be any integer dtype. Unlike
    the torch path (which raises), a slot outside ``[0, num_slots)`` is skipped: checking would
    cost a host sync on every call.
    """
    check_paged_kv(cache)
    check_int_tensor("slot_mapping", slot_mapping, 1)
    check_same_device(k=k, v=v, slot_mapping=slot_mapping, k_cache=cache.k)
    num_blocks, block_size, kv_heads, head_dim = cache.k.shape
    tokens = slot_mapping.shape[0]
    if k.shape != (tokens, kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(
            f"k and v must be [{tokens}, {kv_heads}, {head_dim}] to match slot_mapping and the "
            f"cache; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k,
        v,
        slot_mapping.contiguous(),
        cache.k,
        cache.v,
        num_blocks * block_size,
        *k.stride(),
        *v.stride(),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_pow2(kv_heads),
        DIM_PAD=next_pow2(head_dim),
        num_warps=1 if kv_heads * head_dim <= 256 else 4,
    )
