"""The Triton kernels against the torch path and the naive dense reference.

Without a GPU they run on CPU tensors under Triton's interpreter (see conftest.py), where every
program instance costs about a millisecond, so the cases are tiny: a few hundred programs per
call at most. The ``gpu`` tests rerun the same checks with compiled kernels on CUDA tensors.
"""

import os

import torch

# Before the Triton kernels are defined (conftest.py does the same for the whole folder).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from types import ModuleType

import pytest
from dense_attention import (
    PagedCase,
    default_scale,
    dense_attention,
    make_paged_case,
)

import radixlang.kernels as kernels
from radixlang.kernels import reference
from radixlang.kernels import triton_decode_attention as triton_decode
from radixlang.kernels import triton_extend_attention as triton_extend
from radixlang.kernels import triton_store_kv as triton_store
from radixlang.kernels.layout import PagedKV

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRETED, reason="Triton interpreter off (a GPU is present); the gpu tests cover this"
)

SHAPES = [  # (heads, kv_heads, head_dim, block_size)
    (4, 2, 16, 16),
    (2, 1, 16, 5),
    (4, 4, 16, 3),
    (6, 2, 12, 5),  # group of 3 and a head_dim that is not a power of two
]
FP32_TOL = 1e-5
BF16_TOL = 2e-2


# --- shared checks (device-agnostic) ---------------------------------------------------------


def fused_views(tokens: int, widths: list[int], head_dim: int, dtype, device, seed: int):
    """Strided ``[tokens, width, head_dim]`` views of one fused tensor, as a QKV projection."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(tokens, sum(widths), head_dim, generator=gen).to(dtype).to(device)
    views, start = [], 0
    for width in widths:
        views.append(fused[:, start : start + width])
        start += width
    return views


def poison(case: PagedCase, keep: list[int]) -> None:
    """NaN into every cache slot but each sequence's first ``keep[i]`` tokens, and point the
    block-table padding at a NaN block: a kernel that reads any of them returns NaN."""
    bs = case.cache.block_size
    tables = case.block_tables.cpu()
    used = torch.zeros(case.cache.k.shape[:2], dtype=torch.bool)
    owned = set()
    for row, (n, total) in enumerate(zip(keep, case.seq_lens, strict=True)):
        blocks = -(-total // bs)
        owned.update(tables[row, :blocks].tolist())
        for pos in range(n):
            used[tables[row, pos // bs], pos % bs] = True
    spare = min(set(range(case.cache.k.shape[0])) - owned)
    for row, total in enumerate(case.seq_lens):
        tables[row, -(-total // bs) :] = spare
    unused = (~used).to(case.cache.k.device)
    case.cache.k[unused] = float("nan")
    case.cache.v[unused] = float("nan")
    case.block_tables.copy_(tables)


def check_store_kv(device, cache_dtype, slot_dtype, block_size, tol=0.0):
    """Relative tolerance ``tol`` (0: bit-exact) against the torch path's copy and cast."""
    kv_heads, head_dim, num_blocks = 2, 12, 4
    gen = torch.Generator().manual_seed(block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    pool = [torch.randn(shape, generator=gen).to(cache_dtype).to(device) for _ in range(2)]
    cache, want = PagedKV(*pool), PagedKV(pool[0].clone(), pool[1].clone())
    tokens = 7
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    _, k, v = fused_views(tokens, [kv_heads] * 3, head_dim, torch.float32, device, seed=1)
    slot_mapping = slots.to(slot_dtype).to(device)
    triton_store.store_kv(k, v, slot_mapping, cache)
    reference.store_kv(k, v, slot_mapping, want)
    # Casting to the cache dtype must round exactly as torch does; other slots stay untouched.
    torch.testing.assert_close(cache.k, want.k, atol=0, rtol=tol)
    torch.testing.assert_close(cache.v, want.v, atol=0, rtol=tol)
    flat = cache.k.view(-1, kv_heads, head_dim)
    torch.testing.assert_close(flat[slots.to(device)], k.to(cache_dtype), atol=0, rtol=tol)


def check_decode(
    device,
    heads,
    kv_heads,
    head_dim,
    block_size,
    lens,
    *,
    dtype=torch.float32,
    tol=FP32_TOL,
    partition_tokens=None,
    poisoned=False,
    seed=0,
):
    case = make_paged_case(lens, kv_heads, head_dim, block_size, dtype=dtype, device=device)
    q = fused_views(len(lens), [heads, 2 * kv_heads], head_dim, dtype, device, seed)[0]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = default_scale(head_dim)
    args = (q, case.cache, case.block_tables, seq_lens, scale)
    want_ref = None if poisoned else reference.decode_attention(*args)
    if poisoned:
        poison(case, lens)  # the torch path gathers padding blocks too, so only dense compares
    extra = {} if partition_tokens is None else {"partition_tokens": partition_tokens}
    out = triton_decode.decode_attention(*args, **extra)
    assert out.dtype == q.dtype and out.shape == q.shape
    if want_ref is not None:
        torch.testing.assert_close(out.float(), want_ref.float(), atol=tol, rtol=tol)
    for row, n in enumerate(lens):
        want = dense_attention(
            q[row : row + 1].cpu(), case.k[row].cpu(), case.v[row].cpu(), [n - 1], scale
        )
        torch.testing.assert_close(out[row : row + 1].cpu().double(), want, atol=tol, rtol=tol)


def check_extend(
    device,
    heads,
    kv_heads,
    head_dim,
    block_size,
    prefix_lens,
    extend_lens,
    *,
    dtype=torch.float32,
    tol=FP32_TOL,
    block_m=None,
    seed=7,
):
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    case = make_paged_case(totals, kv_heads, head_dim, block_size, dtype=dtype, device=device)
    tokens = sum(extend_lens)
    q, k_new, v_new = fused_views(tokens, [heads, kv_heads, kv_heads], head_dim, dtype, device, 3)
    k_new.copy_(torch.cat([k[p:] for k, p in zip(case.k, prefix_lens, strict=True)]))
    v_new.copy_(torch.cat([v[p:] for v, p in zip(case.v, prefix_lens, strict=True)]))
    # New tokens must come from k_new/v_new and padding must never be read: NaN everywhere else.
    poison(case, prefix_lens)
    scale = default_scale(head_dim)
    args = (
        q,
        k_new,
        v_new,
        case.cache,
        case.block_tables,
        torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        torch.tensor(extend_lens, dtype=torch.int32, device=device),
        scale,
    )
    extra = {} if block_m is None else {"block_m": block_m}
    out = triton_extend.extend_attention(*args, **extra)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(
        out.float(), reference.extend_attention(*args).float(), atol=tol, rtol=tol
    )
    start = 0
    for row, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        positions = list(range(p, p + e))
        want = dense_attention(
            q[start : start + e].cpu(), case.k[row].cpu(), case.v[row].cpu(), positions, scale
        )
        got = out[start : start + e].cpu().double()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        start += e


def extend_lens_for(block_size: int) -> tuple[list[int], list[int]]:
    # Prefix 0, prefixes ending mid-block and on a block edge, one-token and empty extends,
    # and an extend long enough for several query blocks of 16.
    prefix_lens = [0, 3, block_size, 7, 0, 2]
    extend_lens = [4, 1, 9, 2 * block_size + 1, 1, 0]
    return prefix_lens, extend_lens


# --- CPU, under the interpreter --------------------------------------------------------------


@interpreted
@pytest.mark.parametrize(
    ("cache_dtype", "slot_dtype", "block_size"),
    [
        (torch.float32, torch.int64, 16),
        (torch.bfloat16, torch.int32, 5),
        (torch.float32, torch.int16, 3),
    ],
)
def test_store_kv_matches_torch_path(cache_dtype, slot_dtype, block_size):
    # The interpreter truncates float32 -> bfloat16 (GPUs round to nearest even, as torch
    # does): allow one bfloat16 step here; the gpu test demands exact equality.
    tol = 2.0**-7 if cache_dtype == torch.bfloat16 else 0.0
    check_store_kv("cpu", cache_dtype, slot_dtype, block_size, tol=tol)


@interpreted
def test_store_kv_skips_slots_outside_the_cache():
    cache = PagedKV(torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8))
    k, v = torch.ones(3, 1, 8), torch.ones(3, 1, 8)
    triton_store.store_kv(k, v, torch.tensor([-1, 5, 8]), cache)
    assert cache.k.view(-1, 8).sum(1).tolist() == [0, 0, 0, 0, 0, 8, 0, 0]
    assert torch.equal(cache.k, cache.v)


@interpreted
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("partition_tokens", [None, 8], ids=["one-partition", "split-kv"])
def test_decode_matches_torch_and_dense(heads, kv_heads, head_dim, block_size, partition_tokens):
    # One-token, exactly-one-block, one-past-a-block and multi-partition sequences.
    lens = [1, 5, block_size, block_size + 1, 3 * block_size + 2]
    check_decode(
        "cpu", heads, kv_heads, head_dim, block_size, lens, partition_tokens=partition_tokens
    )


@interpreted
def test_decode_merges_more_partitions_than_one_reduce_step():
    # 100 tokens in partitions of one 3-token block: 34 partitions, over REDUCE_PARTS (16).
    check_decode("cpu", 2, 1, 16, 3, [100, 1], partition_tokens=3)


@interpreted
@pytest.mark.parametrize("partition_tokens", [None, 8], ids=["one-partition", "split-kv"])
def test_decode_never_reads_padding_or_stale_slots(partition_tokens):
    check_decode("cpu", 4, 2, 16, 5, [1, 7, 23], partition_tokens=partition_tokens, poisoned=True)


@interpreted
@pytest.mark.parametrize("partition_tokens", [None, 8], ids=["one-partition", "split-kv"])
def test_decode_zero_length_sequence_gives_zeros(partition_tokens):
    case = make_paged_case([0, 20], 1, 16, 4)
    q = torch.randn(2, 2, 16)
    extra = {} if partition_tokens is None else {"partition_tokens": partition_tokens}
    out = triton_decode.decode_attention(
        q, case.cache, case.block_tables, torch.tensor([0, 20]), 0.25, **extra
    )
    assert torch.equal(out[0], torch.zeros(2, 16))
    assert out[1].isfinite().all()


@interpreted
def test_decode_bfloat16():
    check_decode(
        "cpu", 4, 2, 16, 16, [33, 2, 1], dtype=torch.bfloat16, tol=BF16_TOL, partition_tokens=16
    )


@interpreted
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_extend_matches_torch_and_dense(heads, kv_heads, head_dim, block_size):
    prefix_lens, extend_lens = extend_lens_for(block_size)
    check_extend("cpu", heads, kv_heads, head_dim, block_size, prefix_lens, extend_lens, block_m=16)


@interpreted
def test_extend_default_tiles():
    prefix_lens, extend_lens = extend_lens_for(5)
    check_extend("cpu", 2, 1, 16, 5, prefix_lens, extend_lens)


@interpreted
def test_extend_bfloat16():
    check_extend(
        "cpu", 4, 2, 16, 16, [0, 21], [18, 3], dtype=torch.bfloat16, tol=BF16_TOL, block_m=16
    )


@interpreted
def test_public_dispatch_takes_the_triton_path(monkeypatch):
    monkeypatch.setenv("RADIXLANG_KERNELS", "triton")
    lens, prefix_lens, extend_lens = [9, 1], [6, 0], [3, 1]
    case = make_paged_case(lens, 1, 16, 4)
    q = torch.randn(2, 2, 16)
    seq_lens = torch.tensor(lens)
    want_decode = reference.decode_attention(q, case.cache, case.block_tables, seq_lens, 0.3)
    qe = torch.randn(4, 2, 16)
    k_new = torch.cat([case.k[0][6:], case.k[1]])
    v_new = torch.cat([case.v[0][6:], case.v[1]])
    ext_args = (
        qe,
        k_new,
        v_new,
        case.cache,
        case.block_tables,
        torch.tensor(prefix_lens),
        torch.tensor(extend_lens),
        0.3,
    )
    want_extend = reference.extend_attention(*ext_args)
    stored = PagedKV(torch.zeros_like(case.cache.k), torch.zeros_like(case.cache.v))
    want_stored = PagedKV(torch.zeros_like(case.cache.k), torch.zeros_like(case.cache.v))
    slots = torch.tensor([3, 0, 17])
    reference.store_kv(k_new[:3], v_new[:3], slots, want_stored)

    def torch_path(*_args, **_kwargs):
        raise AssertionError("the torch path ran")

    for name in ("store_kv", "decode_attention", "extend_attention"):
        monkeypatch.setattr(reference, name, torch_path)
    kernels.store_kv(k_new[:3], v_new[:3], slots, stored)
    torch.testing.assert_close(stored.k, want_stored.k, atol=0, rtol=0)
    out = kernels.decode_attention(q, case.cache, case.block_tables, seq_lens, 0.3)
    torch.testing.assert_close(out, want_decode, atol=FP32_TOL, rtol=FP32_TOL)
    out = kernels.extend_attention(*ext_args)
    torch.testing.assert_close(out, want_extend, atol=FP32_TOL, rtol=FP32_TOL)
    # Importing the Triton modules did not replace the package's functions of the same name.
    for name in ("store_kv", "decode_attention", "extend_attention"):
        assert not isinstance(getattr(kernels, name), ModuleType)


def test_wrappers_refuse_bad_inputs():
    case = make_paged_case([5], 2, 16, 4)
    lens = torch.tensor([5])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        triton_decode.decode_attention(
            torch.randn(1, 3, 16), case.cache, case.block_tables, lens, 1
        )
    with pytest.raises(ValueError, match="dtype"):
        triton_decode.decode_attention(
            torch.randn(1, 4, 16).double(), case.cache, case.block_tables, lens, 1
        )
    with pytest.raises(ValueError, match="capacity"):
        triton_decode.decode_attention(
            torch.randn(1, 4, 16), case.cache, case.block_tables, torch.tensor([9]), 1
        )
    with pytest.raises(ValueError, match="integer"):
        triton_decode.decode_attention(
            torch.randn(1, 4, 16), case.cache, case.block_tables, lens.float(), 1
        )
    q, kv = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    ext = (case.cache, case.block_tables, torch.tensor([2]))
    with pytest.raises(ValueError, match="sum to 2"):
        triton_extend.extend_attention(q, kv, kv, *ext, torch.tensor([2]), 1.0)
    with pytest.raises(ValueError, match="capacity"):
        triton_extend.extend_attention(
            q, kv, kv, *ext[:2], torch.tensor([6]), torch.tensor([3]), 1.0
        )
    with pytest.raises(ValueError, match="block_m"):
        triton_extend.extend_attention(q, kv, kv, *ext, torch.tensor([3]), 1.0, block_m=24)
    with pytest.raises(ValueError, match="integer"):
        triton_store.store_kv(kv, kv, torch.zeros(3), case.cache)
    with pytest.raises(ValueError, match="k and v"):
        triton_store.store_kv(kv, kv, torch.zeros(2, dtype=torch.long), case.cache)


# --- GPU, compiled --------------------------------------------------------------------------

GPU_FP32_TOL = 5e-5  # float32 dots run as 3xTF32 on the tensor cores


@pytest.mark.parametrize(
    ("cache_dtype", "slot_dtype", "block_size"),
    [(torch.float32, torch.int64, 16), (torch.bfloat16, torch.int32, 5)],
)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_store_kv(cache_dtype, slot_dtype, block_size):
    check_store_kv("cuda", cache_dtype, slot_dtype, block_size)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("partition_tokens", [None, 8], ids=["one-partition", "split-kv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode(heads, kv_heads, head_dim, block_size, partition_tokens, dtype):
    lens = [1, 5, block_size, block_size + 1, 3 * block_size + 2]
    tol = GPU_FP32_TOL if dtype == torch.float32 else BF16_TOL
    check_decode(
        "cuda",
        heads,
        kv_heads,
        head_dim,
        block_size,
        lens,
        dtype=dtype,
        tol=tol,
        partition_tokens=partition_tokens,
    )
    check_decode(
        "cuda", heads, kv_heads, head_dim, block_size, lens, dtype=dtype, tol=tol, poisoned=True
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_default_model_shape():
    # 9 query heads over 3 KV heads, head_dim 64: 700 tokens span three 256-token partitions.
    lens = [1, 17, 300, 700]
    check_decode("cuda", 9, 3, 64, 16, lens, dtype=torch.bfloat16, tol=BF16_TOL)
    check_decode("cuda", 9, 3, 64, 16, lens, tol=GPU_FP32_TOL)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("block_m", [None, 16], ids=["default-tiles", "block-m-16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_extend(heads, kv_heads, head_dim, block_size, block_m, dtype):
    prefix_lens, extend_lens = extend_lens_for(block_size)
    tol = GPU_FP32_TOL if dtype == torch.float32 else BF16_TOL
    check_extend(
        "cuda",
        heads,
        kv_heads,
        head_dim,
        block_size,
        prefix_lens,
        extend_lens,
        dtype=dtype,
        tol=tol,
        block_m=block_m,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_extend_default_model_shape():
    prefix_lens, extend_lens = [0, 200, 37], [300, 129, 1]
    check_extend("cuda", 9, 3, 64, 16, prefix_lens, extend_lens, dtype=torch.bfloat16, tol=BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_is_cuda_graph_capturable():
    # The decode wrapper reads nothing back to the host, so a decode step can be a CUDA graph.
    lens = [3, 40, 17]
    case = make_paged_case(lens, 2, 16, 16, device="cuda")
    q = torch.randn(3, 4, 16, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    args = (q, case.cache, case.block_tables, seq_lens, 0.25)
    eager = triton_decode.decode_attention(*args, partition_tokens=16)  # compiles first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_decode.decode_attention(*args, partition_tokens=16)
    q.copy_(torch.randn(3, 4, 16, device="cuda"))
    graph.replay()
    torch.testing.assert_close(
        captured, reference.decode_attention(*args), atol=GPU_FP32_TOL, rtol=GPU_FP32_TOL
    )
    assert not torch.equal(captured, eager)
