"""Paged-KV attention kernels: one API, a Triton path for GPUs and a torch path for CPUs.

The bottom layer: it imports torch and triton only, never the runtime, the language or the
server (pyproject's import-linter contracts).

The path follows the tensors' device. ``RADIXLANG_KERNELS=torch`` forces the torch path
everywhere; ``RADIXLANG_KERNELS=triton`` forces Triton (on CPU tensors that needs
``TRITON_INTERPRET=1`` set before Triton is imported, which is how CI tests the kernels).
The Triton modules are imported only when first used.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from radixlang.kernels import reference
from radixlang.kernels.layout import PagedKV, check_paged_kv

__all__ = [
    "PagedKV",
    "check_paged_kv",
    "decode_attention",
    "extend_attention",
    "plan_decode",
    "store_kv",
]


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether calls on ``tensor`` take the Triton path."""
    mode = os.environ.get("RADIXLANG_KERNELS", "auto")
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"RADIXLANG_KERNELS must be auto, torch or triton; got {mode!r}")
    if mode == "auto":
        return tensor.is_cuda
    return mode == "triton"


def store_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, cache: PagedKV) -> None:
    """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into the cache slots given."""
    if use_triton(k):
        from radixlang.kernels import triton_store_kv

        triton_store_kv.store_kv(k, v, slot_mapping, cache)
    else:
        reference.store_kv(k, v, slot_mapping, cache)


def plan_decode(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, cache: PagedKV
) -> reference.DecodePlan | None:
    """Per-batch work that every layer's ``decode_attention`` would repeat (torch path only).

    Build it once per forward pass and pass it to each layer's call as ``plan=``.
    """
    if use_triton(block_tables):
        return None
    return reference.plan_decode(block_tables, seq_lens, cache)


def decode_attention(
    q: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: reference.DecodePlan | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence (``q`` ``[batch, heads, dim]``) over its cache."""
    if use_triton(q):
        from radixlang.kernels import triton_decode_attention

        return triton_decode_attention.decode_attention(q, cache, block_tables, seq_lens, scale)
    return reference.decode_attention(q, cache, block_tables, seq_lens, scale, plan)


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
) -> torch.Tensor:
    """Packed new tokens attend to their cached prefix and causally to each other.

    ``host_lens`` (the prefix and extend lengths as Python ints) saves reading them back from
    the device, a synchronisation per call on a GPU.
    """
    args = (q, k_new, v_new, cache, block_tables, prefix_lens, extend_lens, scale)
    if use_triton(q):
        from radixlang.kernels import triton_extend_attention

        return triton_extend_attention.extend_attention(*args, host_lens=host_lens)
    return reference.extend_attention(*args, host_lens=host_lens)
