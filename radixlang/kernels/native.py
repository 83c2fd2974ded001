"""The C++ CPU paged-attention kernel (``native/paged_attention.cpp``) behind the kernel API.

It reads K and V blocks where they lie in the pool: no gather into a copy, each KV head's block
read once for all the query heads of its GQA group, the work spread over sequences, KV heads
and (for few long sequences) token ranges on torch's own OpenMP threads. Runs of several
queries of one sequence (an extend, drafts to verify) take a tiled path outside uniform mode:
K transposed per chunk so that scores come out a vector of tokens at a time, outputs kept in
registers (about 2x faster than query by query at 6 queries per sequence).

Every query reads its tokens from the cache, its own included, so the new tokens' K/V must be
stored before attention runs (the model does; ``extend_attention`` takes ``stored=True`` to say
so). ``available()`` builds the library on first use and says whether it works here; the torch
path is the fallback.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlang.kernels import native_build
from radixlang.kernels.layout import PagedKV

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# A lone long sequence (decode at small batch) is split into token ranges of about this many
# tokens when its KV heads alone would leave threads idle; the parts are merged afterwards.
SPLIT_TOKENS = 256


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_build.load("paged_attention")
    fn = lib.radixlang_paged_attention
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    fn.argtypes = [p, i, p, p, i, p, i64, p, p, p, i, p, i, i, i, i, f, i, i, i]
    fn.restype = ctypes.c_int
    return lib


@functools.cache
def available() -> bool:
    """Whether the native kernel is built and loads here (``RADIXLANG_NATIVE=0`` turns it off).

    A failed build warns once, with the compiler's message, and the torch path takes over.
    """
    return native_build.usable(_library, "native CPU attention")


def supports(q: torch.Tensor, cache: PagedKV) -> bool:
    """Whether the kernel takes these tensors: CPU, known dtypes, head sizes in its limits."""
    lib = _library()
    heads, dim = q.shape[-2], q.shape[-1]
    kv_heads = cache.kv_heads
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPE_CODES
        and cache.k.dtype in DTYPE_CODES
        and cache.v.dtype == cache.k.dtype
        and heads % kv_heads == 0
        and heads // kv_heads <= lib.radixlang_max_rows()
        and dim <= lib.radixlang_max_dim()
    )


@dataclass(frozen=True)
class NativePlan:
    """What the kernel needs besides the tensors: per query its row of the block tables, how
    many cached tokens it sees and, under a sliding window, the first of them it sees; built
    once per forward and shared by every layer of that window."""

    block_tables: torch.Tensor  # int32, contiguous
    q_seq: torch.Tensor  # [queries] int32
    q_len: torch.Tensor  # [queries] int32
    q_start: torch.Tensor | None = None  # [queries] int32; None: every query sees from 0
    # Each query's result a function of its own inputs only, whatever the batch (no splits;
    # see paged_attention.cpp): deterministic inference.
    uniform: bool = False


def plan_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None = None,
    uniform: bool = False,
) -> NativePlan:
    """One query per sequence, seeing its ``seq_lens[i]`` tokens (the last ``window`` only)."""
    rows = torch.arange(block_tables.shape[0], dtype=torch.int32)
    lens = _int32(seq_lens)
    start = None if window is None else (lens - window).clamp_(min=0).to(torch.int32)
    return NativePlan(_int32(block_tables), rows, lens, start, uniform)


def plan_extend(
    block_tables: torch.Tensor,
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    window: int | None = None,
    uniform: bool = False,
) -> NativePlan:
    """Sequence i's ``extend_lens[i]`` new tokens, the j-th seeing ``prefix_lens[i] + j + 1``
    tokens (the last ``window`` of them only)."""
    seq: list[int] = []
    length: list[int] = []
    for row, (prefix, n) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        seq += [row] * n
        length += range(prefix + 1, prefix + n + 1)
    lens = torch.tensor(length, dtype=torch.int32)
    start = None if window is None else (lens - window).clamp_(min=0).to(torch.int32)
    queries = torch.tensor(seq, dtype=torch.int32)
    return NativePlan(_int32(block_tables), queries, lens, start, uniform)


def merge_plans(extend: NativePlan, decode: NativePlan) -> NativePlan:
    """One plan for a batch whose extends (``extend``'s queries, its rows of the block
    tables) come before its decodes (``decode``'s): a mixed batch in one call per layer."""
    if extend.uniform != decode.uniform or (extend.q_start is None) != (decode.q_start is None):
        raise ValueError("plans of one batch share their mode and window")
    rows = extend.block_tables.shape[0]
    start = None
    if extend.q_start is not None and decode.q_start is not None:
        start = torch.cat([extend.q_start, decode.q_start])
    return NativePlan(
        torch.cat([extend.block_tables, decode.block_tables]),
        torch.cat([extend.q_seq, decode.q_seq + rows]),
        torch.cat([extend.q_len, decode.q_len]),
        start,
        extend.uniform,
    )


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def paged_attention(
    q: torch.Tensor, cache: PagedKV, plan: NativePlan, scale: float
) -> torch.Tensor:
    """``q`` ``[queries, heads, dim]`` attends to the cached tokens ``plan`` gives each query."""
    q = q.contiguous()
    queries, heads, dim = q.shape
    if plan.q_seq.shape[0] != queries:
        raise ValueError(f"the plan covers {plan.q_seq.shape[0]} queries; q has {queries}")
    out = torch.empty_like(q)
    if queries == 0:
        return out
    code = _library().radixlang_paged_attention(
        q.data_ptr(),
        DTYPE_CODES[q.dtype],
        cache.k.data_ptr(),
        cache.v.data_ptr(),
        DTYPE_CODES[cache.k.dtype],
        plan.block_tables.data_ptr(),
        plan.block_tables.stride(0),
        plan.q_seq.data_ptr(),
        plan.q_len.data_ptr(),
        None if plan.q_start is None else plan.q_start.data_ptr(),
        queries,
        out.data_ptr(),
        heads,
        cache.kv_heads,
        dim,
        cache.block_size,
        scale,
        torch.get_num_threads(),
        SPLIT_TOKENS,
        int(plan.uniform),
    )
    if code != 0:
        raise ValueError(
            f"native attention refused heads={heads} kv_heads={cache.kv_heads} dim={dim}"
        )
    return out
