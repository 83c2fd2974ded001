"""Paged-KV attention kernels: one API, a Triton path for GPUs and a torch path for CPUs.

The bottom layer: it imports torch and triton only, never the runtime, the language or the
server (pyproject's import-linter contracts).

The path follows the tensors' device: Triton on GPUs; on CPUs the C++ kernel of ``native.py``
(built with the machine's compiler on first use) where it builds, else the torch path.
``RADIXLANG_KERNELS=torch`` forces the torch path everywhere, ``native`` the C++ kernel on CPU
tensors, ``triton`` Triton (on CPU tensors that needs ``TRITON_INTERPRET=1`` set before Triton is
imported, which is how CI tests the kernels). The Triton modules are imported only when first
used.

Sliding windows (``window=W``: the token at position p sees positions ``p - W + 1 .. p``, as
transformers' Mistral masks them) run on every path. No path reads the blocks wholly before a
query's window, so a caller may put any block id there (say, of a block it has released).

``deterministic=True`` (deterministic inference) makes every path compute each query's output
from that query's own inputs only, with no split or order chosen by the batch: the native
kernel's uniform mode, the torch path query by query, Triton's decode kernel with a sequential
merge of its fixed-size KV partitions (and an extend's tokens run through it as queries of
their own). A token's attention is then bitwise the same alone or in any batch, and whether
it was computed in an extend or as a decode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from radixlang.kernels import native, reference
from radixlang.kernels.layout import PagedKV, check_paged_kv

MODES = ("auto", "torch", "native", "triton")
# On CPUs an extend whose sequences compute at most this many tokens each runs on the native
# kernel; longer ones on torch's flash attention, whose blocked matmuls win on long runs
# (measured on the default model's heads: 16 new tokens 0.07 vs 0.12 ms, 64 about even after a
# 1,000-token prefix already 1.4x slower at 32, 2,048 new tokens 2x slower).
NATIVE_EXTEND_MAX_TOKENS = 16

NativePlan = native.NativePlan
QueryPlan = reference.QueryPlan
AttentionPlan = reference.DecodePlan | native.NativePlan | reference.QueryPlan
ExtendPlan = native.NativePlan | reference.QueryPlan

__all__ = [
    "AttentionPlan",
    "ExtendPlan",
    "NativePlan",
    "PagedKV",
    "QueryPlan",
    "check_paged_kv",
    "decode_attention",
    "extend_attention",
    "merge_plans",
    "plan_decode",
    "plan_extend",
    "planned_attention",
    "store_kv",
]


def kernel_mode() -> str:
    mode = os.environ.get("RADIXLANG_KERNELS", "auto")
    if mode not in MODES:
        raise ValueError(f"RADIXLANG_KERNELS must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether calls on ``tensor`` take the Triton path."""
    mode = kernel_mode()
    if mode == "auto":
        return tensor.is_cuda
    return mode == "triton"


def use_native(q: torch.Tensor, cache: PagedKV) -> bool:
    """Whether attention of ``q`` over ``cache`` takes the C++ CPU kernel."""
    mode = kernel_mode()
    if mode not in ("auto", "native") or q.device.type != "cpu":
        return False
    if mode == "native":
        if not native.available():
            raise RuntimeError("RADIXLANG_KERNELS=native but the native kernel did not build")
        return native.supports(q, cache)
    return native.available() and native.supports(q, cache)


def store_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, cache: PagedKV) -> None:
    """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into the cache slots given."""
    if use_triton(k):
        from radixlang.kernels import triton_store_kv

        triton_store_kv.store_kv(k, v, slot_mapping, cache)
    else:
        reference.store_kv(k, v, slot_mapping, cache)


def plan_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cache: PagedKV,
    q: torch.Tensor,
    window: int | None = None,
    deterministic: bool = False,
) -> AttentionPlan | None:
    """Per-batch work that every layer's ``decode_attention`` would repeat (CPU paths only).

    Build it once per forward pass and window (``q`` is any layer's queries, for the path's
    choice) and pass it to each call with that window as ``plan=``.
    """
    if use_triton(q):
        return None
    if use_native(q, cache):
        return native.plan_decode(block_tables, seq_lens, window, uniform=deterministic)
    if deterministic:
        return reference.plan_queries(block_tables, None, seq_lens.tolist(), window)
    return reference.plan_decode(block_tables, seq_lens, cache, window)


def plan_extend(
    block_tables: torch.Tensor,
    host_lens: tuple[Sequence[int], Sequence[int]],
    cache: PagedKV,
    q: torch.Tensor,
    window: int | None = None,
    deterministic: bool = False,
) -> ExtendPlan | None:
    """The plan for an extend whose new K/V are stored: the native kernel's, or None where
    another path runs it (a GPU, the torch path, sequences longer than
    ``NATIVE_EXTEND_MAX_TOKENS``). Deterministic extends always get one: the native kernel's
    uniform plan, or the tokens as queries of their own (``QueryPlan``)."""
    prefix_lens, extend_lens = host_lens
    native_kernel = not use_triton(q) and use_native(q, cache)
    if deterministic:
        if native_kernel:
            return native.plan_extend(block_tables, prefix_lens, extend_lens, window, uniform=True)
        return reference.plan_extend_queries(block_tables, prefix_lens, extend_lens, window)
    if not extend_lens or max(extend_lens) > NATIVE_EXTEND_MAX_TOKENS or not native_kernel:
        return None
    return native.plan_extend(block_tables, prefix_lens, extend_lens, window)


def merge_plans(extend: ExtendPlan | None, decode: AttentionPlan | None) -> NativePlan | None:
    """For a batch of extends followed by decodes, one plan that runs all its queries in one
    native call (``planned_attention``); None unless both plans are the native kernel's."""
    if isinstance(extend, native.NativePlan) and isinstance(decode, native.NativePlan):
        return native.merge_plans(extend, decode)
    return None


def planned_attention(
    q: torch.Tensor, cache: PagedKV, plan: NativePlan, scale: float
) -> torch.Tensor:
    """Every query of ``q`` over the cached tokens ``plan`` gives it (the native kernel)."""
    return native.paged_attention(q, cache, plan, scale)


def decode_attention(
    q: torch.Tensor,
    cache: PagedKV,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: AttentionPlan | None = None,
    window: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Attention of one new token per sequence (``q`` ``[batch, heads, dim]``) over its cache,
    its last ``window`` tokens only when a window is given (``plan`` must share it and the
    ``deterministic`` choice)."""
    if use_triton(q):
        from radixlang.kernels import triton_decode_attention

        return triton_decode_attention.decode_attention(
            q, cache, block_tables, seq_lens, scale, window=window, deterministic=deterministic
        )
    if plan is None:
        plan = plan_decode(block_tables, seq_lens, cache, q, window, deterministic)
    if isinstance(plan, native.NativePlan):
        return native.paged_attention(q, cache, plan, scale)
    if isinstance(plan, reference.QueryPlan):
        return reference.query_attention(q, cache, plan, scale)
    return reference.decode_attention(q, cache, block_tables, seq_lens, scale, plan, window)


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
    plan: ExtendPlan | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Packed new tokens attend to their cached prefix and causally to each other; with a
    ``window``, to the last ``window`` positions up to their own only.

    ``host_lens`` (the prefix and extend lengths as Python ints) saves reading them back from
    the device, a synchronisation per call on a GPU. ``plan`` (from ``plan_extend`` with the
    same window, which requires the new tokens' K/V already stored in ``cache``) runs it on the
    native kernel, or (a ``QueryPlan``: deterministic) token by token.
    """
    if isinstance(plan, reference.QueryPlan):
        if use_triton(q):
            from radixlang.kernels import triton_decode_attention

            return triton_decode_attention.decode_attention(
                q, cache, plan.block_tables, plan.seq_lens, scale, window=window, deterministic=True
            )
        return reference.query_attention(q, cache, plan, scale)
    if plan is not None:
        return native.paged_attention(q, cache, plan, scale)
    args = (q, k_new, v_new, cache, block_tables, prefix_lens, extend_lens, scale)
    if use_triton(q):
        from radixlang.kernels import triton_extend_attention

        return triton_extend_attention.extend_attention(*args, host_lens=host_lens, window=window)
    return reference.extend_attention(*args, host_lens=host_lens, window=window)
