"""Sliding-window attention (``window=W``) on the torch path, the native kernel and Triton
(interpreted on CPU; compiled in the ``gpu`` test), against the dense float64 reference with the
window mask.

Every case also poisons what lies before the windows: the blocks wholly before a query's window
are overwritten with NaN, and (as a request that released them would) their table entries point
at a NaN block. A path that read them would return NaN.
"""

import os

import pytest
import torch
from dense_attention import dense_attention, make_paged_case

import radixlang.kernels as kernels
from radixlang.kernels import native, native_build, reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SHAPES = [  # (heads, kv_heads, head_dim, block_size, window)
    (4, 2, 16, 4, 8),
    (6, 6, 8, 5, 7),  # a window that is not a multiple of the block size
    (4, 1, 32, 3, 1),  # a window of one: each query sees itself only
    (8, 2, 64, 16, 40),
]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest.py without a GPU
PATHS = [
    "torch",
    "native",  # skips where no C++ compiler is found (native_kernel below)
    pytest.param("triton", marks=pytest.mark.skipif(
        not INTERPRETED, reason="a GPU is present: the gpu test covers Triton")),
]  # fmt: skip


@pytest.fixture(scope="module")
def native_kernel():
    """Skip where no C++ compiler is found; where one is, a failed build fails the native tests
    with the compiler's message (pytest keeps the module fixture's error)."""
    if reason := native_build.skip_reason(native._library):
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def native_path_built(request):
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("path") == "native":
        request.getfixturevalue("native_kernel")


def poison_before(case, first_positions: list[int]) -> None:
    """NaN into every block wholly before row i's first visible position, and its table entry
    pointed at one NaN block."""
    bs = case.cache.block_size
    nan_block = int(case.block_tables[0, 0])  # any: its contents are about to be NaN anyway
    for row, first in enumerate(first_positions):
        for index in range(first // bs):
            block = int(case.block_tables[row, index])
            case.cache.k[block] = float("nan")
            case.cache.v[block] = float("nan")
    for row, first in enumerate(first_positions):
        if first // bs:
            nan_block = int(case.block_tables[row, 0])
            break
    for row, first in enumerate(first_positions):
        case.block_tables[row, : first // bs] = nan_block


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "window"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_decode_matches_dense(
    monkeypatch, path, heads, kv_heads, head_dim, block_size, window, dtype
):
    monkeypatch.setenv("RADIXLANG_KERNELS", path)
    lens = [1, window, window + 1, 3 * block_size + 2, 70]
    case = make_paged_case(lens, kv_heads, head_dim, block_size, dtype=dtype, seed=heads)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    want = [
        dense_attention(q[i : i + 1], case.k[i], case.v[i], [n - 1], 0.3, window)
        for i, n in enumerate(lens)
    ]
    poison_before(case, [max(0, n - window) for n in lens])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = kernels.plan_decode(case.block_tables, seq_lens, case.cache, q, window)
    assert isinstance(plan, native.NativePlan) == (path == "native")
    for given in (plan, None):
        out = kernels.decode_attention(
            q, case.cache, case.block_tables, seq_lens, 0.3, given, window=window
        )
        tol = TOLERANCE[dtype]
        for i in range(len(lens)):
            torch.testing.assert_close(out[i : i + 1].double(), want[i], atol=tol, rtol=tol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size", "window"), SHAPES)
def test_windowed_extend_matches_dense(
    monkeypatch, path, heads, kv_heads, head_dim, block_size, window
):
    """Chunks over a cached prefix longer than the window, and prompts longer than it."""
    monkeypatch.setenv("RADIXLANG_KERNELS", path)
    monkeypatch.setattr(kernels, "NATIVE_EXTEND_MAX_TOKENS", 1000)  # native runs them all
    prefix_lens = [0, 3, 2 * window + 1, window, 0, 23]
    extend_lens = [window + 5, 1, 9, 2, 3, 16]
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    case = make_paged_case(totals, kv_heads, head_dim, block_size, seed=7)
    q = torch.randn(sum(extend_lens), heads, head_dim)
    k_new = torch.cat([k[p:] for k, p in zip(case.k, prefix_lens, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(case.v, prefix_lens, strict=True)])
    want = []
    start = 0
    for row, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        positions = list(range(p, p + e))
        want.append(
            dense_attention(q[start : start + e], case.k[row], case.v[row], positions, 0.3, window)
        )
        start += e
    poison_before(case, [max(0, p - window + 1) for p in prefix_lens])
    host = (prefix_lens, extend_lens)
    plan = kernels.plan_extend(case.block_tables, host, case.cache, q, window)
    assert (plan is not None) == (path == "native")
    out = kernels.extend_attention(
        q,
        k_new,
        v_new,
        case.cache,
        case.block_tables,
        torch.tensor(prefix_lens, dtype=torch.int32),
        torch.tensor(extend_lens, dtype=torch.int32),
        0.3,
        host,
        plan,
        window=window,
    )
    start = 0
    for row, e in enumerate(extend_lens):
        torch.testing.assert_close(out[start : start + e].double(), want[row], atol=1e-5, rtol=1e-5)
        start += e


@pytest.mark.usefixtures("native_kernel")
def test_native_windowed_split_rows_merge_exactly():
    """Few long rows split into token ranges start the first range at the window."""
    lens, window = [300, 97], 50
    case = make_paged_case(lens, 2, 16, 4, seed=5)
    q = torch.randn(len(lens), 4, 16)
    want = [
        dense_attention(q[i : i + 1], case.k[i], case.v[i], [n - 1], 0.3, window)
        for i, n in enumerate(lens)
    ]
    poison_before(case, [n - window for n in lens])
    plan = native.plan_decode(case.block_tables, torch.tensor(lens), window)
    for split in (0, 8, 13):  # off, many parts, parts that start off a block boundary
        lib = native._library()
        out = torch.empty_like(q)
        lib.radixlang_paged_attention(
            q.data_ptr(), 0, case.cache.k.data_ptr(), case.cache.v.data_ptr(), 0,
            plan.block_tables.data_ptr(), plan.block_tables.stride(0), plan.q_seq.data_ptr(),
            plan.q_len.data_ptr(), plan.q_start.data_ptr(), len(lens), out.data_ptr(), 4, 2, 16,
            4, 0.3, 2, split, 0,  # uniform off
        )  # fmt: skip
        for i in range(len(lens)):
            torch.testing.assert_close(out[i : i + 1].double(), want[i], atol=1e-5, rtol=1e-5)


def test_window_wider_than_the_sequence_changes_nothing():
    lens = [5, 17]
    case = make_paged_case(lens, 2, 8, 4, seed=2)
    q = torch.randn(2, 4, 8)
    seq_lens = torch.tensor(lens)
    whole = reference.decode_attention(q, case.cache, case.block_tables, seq_lens, 0.3)
    windowed = reference.decode_attention(
        q, case.cache, case.block_tables, seq_lens, 0.3, window=17
    )
    torch.testing.assert_close(windowed, whole)


@pytest.mark.skipif(not INTERPRETED, reason="a GPU is present: the gpu test covers Triton")
@pytest.mark.parametrize("partition_tokens", [4, 8, 12])
def test_triton_windowed_decode_skips_partitions_before_the_window(partition_tokens):
    """Split-KV decode: partitions wholly before the window are neither read nor merged."""
    from radixlang.kernels import triton_decode_attention as triton_decode

    lens, window = [37, 9, 1, 20], 6
    case = make_paged_case(lens, 1, 16, 4, seed=11)
    q = torch.randn(len(lens), 2, 16)
    want = [
        dense_attention(q[i : i + 1], case.k[i], case.v[i], [n - 1], 0.3, window)
        for i, n in enumerate(lens)
    ]
    poison_before(case, [max(0, n - window) for n in lens])
    out = triton_decode.decode_attention(
        q, case.cache, case.block_tables, torch.tensor(lens), 0.3,
        partition_tokens=partition_tokens, window=window,
    )  # fmt: skip
    for i in range(len(lens)):
        torch.testing.assert_close(out[i : i + 1].double(), want[i], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_windowed_attention_matches_dense(dtype):
    """The compiled Triton kernels with a window, decode (split-KV too) and extend."""
    from radixlang.kernels import triton_decode_attention as triton_decode
    from radixlang.kernels import triton_extend_attention as triton_extend

    window, tol = 40, (1e-3 if dtype == torch.float32 else 3e-2)
    lens = [1, 39, 41, 300, 777]
    case = make_paged_case(lens, 2, 64, 16, dtype=dtype, device="cuda", seed=1)
    q = torch.randn(len(lens), 8, 64, device="cuda").to(dtype)
    want = [
        dense_attention(q[i : i + 1].cpu(), case.k[i].cpu(), case.v[i].cpu(), [n - 1], 0.3, window)
        for i, n in enumerate(lens)
    ]
    poison_before(case, [max(0, n - window) for n in lens])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for parts in (64, 256):
        out = triton_decode.decode_attention(
            q, case.cache, case.block_tables, seq_lens, 0.3, partition_tokens=parts, window=window
        )
        for i in range(len(lens)):
            got = out[i : i + 1].double().cpu()
            torch.testing.assert_close(got, want[i], atol=tol, rtol=tol)
    prefix_lens, extend_lens = [0, 30, 100, 5], [90, 1, 70, 3]
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    case = make_paged_case(totals, 2, 64, 16, dtype=dtype, device="cuda", seed=2)
    q = torch.randn(sum(extend_lens), 8, 64, device="cuda").to(dtype)
    k_new = torch.cat([k[p:] for k, p in zip(case.k, prefix_lens, strict=True)])
    v_new = torch.cat([v[p:] for v, p in zip(case.v, prefix_lens, strict=True)])
    want, start = [], 0
    for row, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        k, v = case.k[row].cpu(), case.v[row].cpu()
        positions = list(range(p, p + e))
        want.append(dense_attention(q[start : start + e].cpu(), k, v, positions, 0.3, window))
        start += e
    poison_before(case, [max(0, p - window + 1) for p in prefix_lens])
    out = triton_extend.extend_attention(
        q, k_new, v_new, case.cache, case.block_tables,
        torch.tensor(prefix_lens, device="cuda"), torch.tensor(extend_lens, device="cuda"), 0.3,
        window=window,
    )  # fmt: skip
    start = 0
    for row, e in enumerate(extend_lens):
        got = out[start : start + e].double().cpu()
        torch.testing.assert_close(got, want[row], atol=tol, rtol=tol)
        start += e
