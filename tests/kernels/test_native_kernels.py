"""The C++ CPU kernel (kernels/native.py) against the naive dense float64 reference."""

import warnings

import pytest
import torch
from dense_attention import dense_attention, make_paged_case

import radixlang.kernels as kernels
from radixlang.kernels import native, native_build, reference


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    """Skip where no C++ compiler is found; where one is, a failed build fails every test here
    with the compiler's message (pytest keeps the module fixture's error)."""
    if reason := native_build.skip_reason(native._library):
        pytest.skip(reason)


SHAPES = [  # (heads, kv_heads, head_dim, block_size)
    (9, 3, 64, 16),  # the default model's heads
    (8, 2, 16, 16),
    (6, 6, 8, 5),
    (4, 1, 32, 3),
    (4, 2, 128, 1),
    (2, 2, 24, 7),  # a head size the kernel has no specialisation for
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def check_decode(case, q, lens, scale, out):
    for row, n in enumerate(lens):
        want = dense_attention(q[row : row + 1], case.k[row], case.v[row], [n - 1], scale)
        tol = TOLERANCE[q.dtype]
        torch.testing.assert_close(out[row : row + 1].double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_matches_dense(heads, kv_heads, head_dim, block_size, dtype):
    lens = [1, 5, block_size, block_size + 1, 40, 67]
    case = make_paged_case(lens, kv_heads, head_dim, block_size, dtype=dtype, seed=heads)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = kernels.decode_attention(q, case.cache, case.block_tables, seq_lens, 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    check_decode(case, q, lens, 0.3, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_split_across_threads_merge_exactly(monkeypatch, dtype):
    """Few long sequences are split into token ranges; the merged result is the whole one."""
    lens = [300, 97]
    case = make_paged_case(lens, 2, 16, 4, dtype=dtype, seed=5)
    q = torch.randn(len(lens), 4, 16).to(dtype)
    plan = native.plan_decode(case.block_tables, torch.tensor(lens))
    monkeypatch.setattr(native, "SPLIT_TOKENS", 10**6)
    whole = native.paged_attention(q, case.cache, plan, 0.25)
    for split in (8, 33, 64):
        monkeypatch.setattr(native, "SPLIT_TOKENS", split)
        parts = native.paged_attention(q, case.cache, plan, 0.25)
        torch.testing.assert_close(parts.float(), whole.float(), atol=TOLERANCE[dtype], rtol=0)
        check_decode(case, q, lens, 0.25, parts)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_extend_matches_dense(heads, kv_heads, head_dim, block_size, dtype):
    check_extend_matches_dense(heads, kv_heads, head_dim, block_size, dtype)


def check_extend_matches_dense(heads, kv_heads, head_dim, block_size, dtype):
    # Tiles of 8 queries cut these runs at different places; a causal tile's first rows see
    # fewer tokens than the chunk it reads.
    prefix_lens = [0, 3, block_size, 7, 0, 50]
    extend_lens = [4, 1, 9, 2 * block_size + 1, 1, 20]
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    case = make_paged_case(totals, kv_heads, head_dim, block_size, dtype=dtype, seed=7)
    q = torch.randn(sum(extend_lens), heads, head_dim).to(dtype)
    # The case stores every token's K/V, the new ones' included, as the plan needs.
    plan = native.plan_extend(case.block_tables, prefix_lens, extend_lens)
    out = kernels.extend_attention(
        q, None, None, case.cache, case.block_tables, None, None, 0.2, plan=plan
    )
    start = 0
    for row, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        positions = list(range(p, p + e))
        want = dense_attention(q[start : start + e], case.k[row], case.v[row], positions, 0.2)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out[start : start + e].double(), want, atol=tol, rtol=tol)
        start += e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiled_path_agrees_with_the_row_path(dtype):
    """Tiles of two or more queries (drafts to verify, short extends) take the tiled path
    outside uniform mode; forced onto the row-by-row path they give the same results."""
    prefix_lens, extend_lens = [90, 33, 0], [6, 2, 9]
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    case = make_paged_case(totals, 3, 64, 16, dtype=dtype, seed=3)
    q = torch.randn(sum(extend_lens), 9, 64).to(dtype)
    plan = native.plan_extend(case.block_tables, prefix_lens, extend_lens)
    lib = native._library()
    tiled = native.paged_attention(q, case.cache, plan, 0.125)
    try:
        lib.radixlang_set_tiled_min_queries(10**6)
        rows = native.paged_attention(q, case.cache, plan, 0.125)
    finally:
        lib.radixlang_set_tiled_min_queries(2)
    assert not torch.equal(tiled, rows) or dtype == torch.bfloat16  # two paths ran
    torch.testing.assert_close(tiled.float(), rows.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("uniform", [False, True])
def test_a_mixed_batch_in_one_call_equals_its_extends_and_decodes_apart(uniform):
    """``merge_plans``: a batch's extends and decodes in one native call give what the two
    calls give (bitwise in uniform mode, where no split depends on the batch)."""
    prefix_lens, extend_lens, decode_lens = [20, 0], [5, 3], [40, 7, 66]
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)] + decode_lens
    case = make_paged_case(totals, 3, 64, 16, dtype=torch.bfloat16, seed=11)
    tables = case.block_tables
    extend = native.plan_extend(tables[:2], prefix_lens, extend_lens, uniform=uniform)
    decode = native.plan_decode(tables[2:], torch.tensor(decode_lens), uniform=uniform)
    q = torch.randn(sum(extend_lens) + len(decode_lens), 9, 64).to(torch.bfloat16)
    n = sum(extend_lens)
    apart = torch.cat([
        native.paged_attention(q[:n], case.cache, extend, 0.125),
        native.paged_attention(q[n:], case.cache, decode, 0.125),
    ])  # fmt: skip
    merged = kernels.merge_plans(extend, decode)
    assert merged is not None
    together = kernels.planned_attention(q, case.cache, merged, 0.125)
    if uniform:
        assert torch.equal(together, apart)
    torch.testing.assert_close(together.float(), apart.float(), atol=2e-2, rtol=0)
    assert kernels.merge_plans(None, decode) is None


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("window", [None, 21, 150])
def test_uniform_mode_gives_a_query_the_same_bits_decoded_or_in_an_extend(
    heads, kv_heads, head_dim, block_size, window
):
    """In uniform mode a query's output depends on its own inputs only: the query at position
    i of an extend (tiled or all-heads, beside other sequences) gets the bits it gets decoded
    alone over the same i + 1 tokens, and a decode batch gives each row its bits alone. Rows
    past 128 tokens are cut into pieces: items of their own when decoded alone, one item's
    sequence of pieces in the extend's many queries."""
    prefix_lens, extend_lens = [0, 137, 300], [45, 30, 3]
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    case = make_paged_case(totals, kv_heads, head_dim, block_size, torch.bfloat16, seed=13)
    q = torch.randn(sum(extend_lens), heads, head_dim)  # float32 out: every bit shows
    extend = native.plan_extend(case.block_tables, prefix_lens, extend_lens, window, uniform=True)
    together = native.paged_attention(q, case.cache, extend, 0.125)
    start = 0
    for row, (p, e) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        table = case.block_tables[row : row + 1]
        for j in (0, 1, e // 2, e - 1):  # the query of the extend seeing p + j + 1 tokens
            alone = native.plan_decode(table, torch.tensor([p + j + 1]), window, uniform=True)
            got = native.paged_attention(q[start + j : start + j + 1], case.cache, alone, 0.125)
            assert torch.equal(got, together[start + j : start + j + 1]), (row, j)
        start += e
    # Decode rows of every sequence, alone and as one batch.
    lens = torch.tensor(totals)
    batch = native.plan_decode(case.block_tables, lens, window, uniform=True)
    rows = native.paged_attention(q[:3], case.cache, batch, 0.125)
    for row in range(3):
        alone = native.plan_decode(
            case.block_tables[row : row + 1], lens[row : row + 1], window, uniform=True
        )
        got = native.paged_attention(q[row : row + 1], case.cache, alone, 0.125)
        assert torch.equal(got, rows[row : row + 1]), row


def test_float32_queries_over_a_bfloat16_cache():
    lens = [12, 40]
    case = make_paged_case(lens, 2, 16, 16, dtype=torch.bfloat16)
    q = torch.randn(len(lens), 4, 16)
    out = kernels.decode_attention(q, case.cache, case.block_tables, torch.tensor(lens), 0.25)
    assert out.dtype == torch.float32
    for row, n in enumerate(lens):
        want = dense_attention(q[row : row + 1], case.k[row], case.v[row], [n - 1], 0.25)
        torch.testing.assert_close(out[row : row + 1].double(), want, atol=1e-4, rtol=1e-4)


def test_padding_blocks_past_a_row_are_never_read():
    """Entries of a block table past the row's length may name any block, even garbage."""
    lens = [5, 40]
    case = make_paged_case(lens, 1, 8, 4)
    q = torch.randn(2, 2, 8)
    tables = case.block_tables.clone()
    tables[0, 2:] = 10**6  # far outside the pool
    out = kernels.decode_attention(q, case.cache, tables, torch.tensor(lens), 0.5)
    check_decode(case, q, lens, 0.5, out)


def test_dispatch_chooses_native_on_cpu_and_obeys_the_override(monkeypatch):
    case = make_paged_case([4], 1, 8, 4)
    q = torch.randn(1, 2, 8)
    monkeypatch.delenv("RADIXLANG_KERNELS", raising=False)
    assert kernels.use_native(q, case.cache)
    assert isinstance(
        kernels.plan_decode(case.block_tables, torch.tensor([4]), case.cache, q), native.NativePlan
    )
    monkeypatch.setenv("RADIXLANG_KERNELS", "torch")
    assert not kernels.use_native(q, case.cache)
    assert isinstance(
        kernels.plan_decode(case.block_tables, torch.tensor([4]), case.cache, q),
        reference.DecodePlan,
    )
    assert kernels.plan_extend(case.block_tables, ([0], [4]), case.cache, q) is None


def test_long_extends_go_to_torch_flash_attention(monkeypatch):
    case = make_paged_case([20], 1, 8, 4)
    q = torch.randn(20, 2, 8)
    monkeypatch.setattr(kernels, "NATIVE_EXTEND_MAX_TOKENS", 19)
    assert kernels.plan_extend(case.block_tables, ([0], [20]), case.cache, q) is None
    monkeypatch.setattr(kernels, "NATIVE_EXTEND_MAX_TOKENS", 20)
    assert kernels.plan_extend(case.block_tables, ([0], [20]), case.cache, q) is not None


def test_a_failed_build_warns_once_and_falls_back_to_torch(monkeypatch):
    def no_compiler() -> str:
        raise native_build.NativeBuildError("no C++ compiler found")

    monkeypatch.setattr(native_build, "find_compiler", no_compiler)
    native._library.cache_clear()
    native.available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
            assert native.available() is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.available() is False  # cached: no second warning
        case = make_paged_case([4], 1, 8, 4)
        q = torch.randn(1, 2, 8)
        assert not kernels.use_native(q, case.cache)
        monkeypatch.setenv("RADIXLANG_KERNELS", "native")
        with pytest.raises(RuntimeError, match="did not build"):
            kernels.use_native(q, case.cache)
    finally:
        native._library.cache_clear()
        native.available.cache_clear()


def test_the_build_is_cached_by_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path))
    first = native_build.build("paged_attention")
    assert first.parent == tmp_path / "native" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native_build.build("paged_attention") == first
    assert first.stat().st_mtime_ns == stamp  # not rebuilt
    assert not list(first.parent.glob("*.tmp"))


@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_an_older_cpu_class_builds_apart_and_computes_the_same(tmp_path, monkeypatch, march):
    """$RADIXLANG_NATIVE_MARCH builds the kernels for another CPU class (x86-64-v3: AVX2, as
    CI's CPUs; skylake-avx512: AVX-512 without bfloat16) into libraries of their own names, so
    one machine runs those classes' code paths: attention agrees with the dense reference, and
    the batch-invariant linear stays row-invariant in bfloat16 without AVX-512 BF16."""
    import platform

    from radixlang.kernels import invariant_linear

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets")
    if march == "skylake-avx512" and "avx512bw" not in native_build._machine_fingerprint():
        pytest.skip("this CPU has no AVX-512")
    monkeypatch.setenv("RADIXLANG_CACHE", str(tmp_path))
    here = native_build.build("paged_attention")
    monkeypatch.setenv("RADIXLANG_NATIVE_MARCH", march)
    assert f"-march={march}" in native_build.compile_flags("invariant_linear")
    caches = (native._library, native.available, invariant_linear._library,
              invariant_linear.available)  # fmt: skip
    for cached in caches:
        cached.cache_clear()
    try:
        assert native.available() and invariant_linear.available()
        built = sorted(p.name for p in tmp_path.glob("native/*.so"))
        assert len(built) == 3 and here.name in built  # this CPU's, and the class's two
        lens = [3, 17, 40]
        case = make_paged_case(lens, 2, 16, 4, seed=1)
        q = torch.randn(len(lens), 4, 16)
        plan = native.plan_decode(case.block_tables, torch.tensor(lens))
        check_decode(case, q, lens, 0.25, native.paged_attention(q, case.cache, plan, 0.25))
        # Extends of several queries: the tiled path, built for the class's vector width.
        check_extend_matches_dense(9, 3, 64, 16, torch.bfloat16)

        weight = torch.randn(40, 300).to(torch.bfloat16)  # K over three passes (of 128)
        x = torch.randn(9, 300).to(torch.bfloat16)
        packed = invariant_linear.pack(weight, None)
        want = invariant_linear.linear(x, packed)
        for rows in (1, 4, 9):
            assert torch.equal(invariant_linear.linear(x[:rows].clone(), packed), want[:rows])
        torch.testing.assert_close(want.float(), x.float() @ weight.float().T, atol=0.1, rtol=2e-2)
    finally:
        for cached in caches:
            cached.cache_clear()


def test_loading_the_native_libraries_keeps_subnormal_floats():
    """-ffast-math at link time would flush subnormals to zero in the whole process."""
    from radixlang.kernels import native_linear

    assert native.available() and native_linear.available()
    tiny = torch.tensor([1e-40])
    assert float(tiny * 1.0) != 0.0
