"""Linears on GGUF's blocks: the C++ kernels against a numpy reference of the same block format
and the same activation quantization, on every code path the kernels have (this CPU's: VNNI
where it has it; x86-64-v3: AVX2 without VNNI; x86-64: scalar). The 32-element formats (Q4_0,
Q4_1, Q8_0) have a reference of their own; the k-quants (Q4_K, Q6_K) are checked against the
gguf package's dequantization. Each is checked in the file's layout and, where the packed kernel
takes the format, repacked (eight rows interleaved)."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from radixlang.kernels import block_linear, native_build
from radixlang.kernels.block_formats import FORMATS, RawBlocks

MARCHES = ["native", "x86-64-v3", "x86-64"]


@pytest.fixture(params=MARCHES)
def kernel(request, tmp_path_factory, monkeypatch):
    """The block kernel built for one CPU class (its own library); skip only without a
    compiler, fail with the compiler's message on a build error."""
    march = request.param
    if march != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets")
    if march != "native":
        monkeypatch.setenv("RADIXLANG_NATIVE_MARCH", march)
    clear_libraries()
    for library in LIBRARIES:
        if reason := native_build.skip_reason(library):
            pytest.skip(reason)
    yield march
    clear_libraries()


LIBRARIES = (block_linear._library, block_linear._kquant_library, block_linear._packed_library)


def clear_libraries() -> None:
    for cached in (*LIBRARIES, block_linear.available):
        cached.cache_clear()


# ---- the numpy reference --------------------------------------------------------------------


def reference_quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per 32-element block: d = max|x| / 127, q = round-half-even(x * (1 / d)), in float32."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    d = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0))
    q = np.rint(blocks * inv.astype(np.float32)[:, :, None]).astype(np.int32)
    return q.reshape(m, k).astype(np.int8), d, q.sum(axis=2).astype(np.int32)


def reference_blocks(blocks: RawBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values [rows, cols] as integers, scales, mins [rows, cols / 32]) of the GGUF bytes."""
    rows, nb, size = blocks.rows, blocks.cols // 32, blocks.format.block_bytes
    raw = blocks.data.reshape(rows, nb, size)
    d = raw[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    mins = np.zeros_like(d)
    if blocks.format.name == "Q8_0":
        values = raw[:, :, 2:34].copy().view(np.int8).astype(np.int64)
    else:
        start = 4 if blocks.format.name == "Q4_1" else 2
        if blocks.format.name == "Q4_1":
            mins = raw[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
        qs = raw[:, :, start : start + 16].astype(np.int64)
        values = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # low nibbles are elements 0..15
        if blocks.format.name == "Q4_0":
            values = values - 8
    return values.reshape(rows, -1), d, mins


def reference_linear(x: np.ndarray, blocks: RawBlocks) -> tuple[np.ndarray, np.ndarray]:
    """x @ W.T as the kernel defines it, in float64, and the sum of the terms' magnitudes (the
    scale of the kernel's float32 rounding)."""
    qx, dx, sx = reference_quantize_rows(x)
    w, dw, mw = reference_blocks(blocks)
    m, k = x.shape
    nb = k // 32
    dots = np.einsum(
        "mbj,nbj->mnb", qx.astype(np.int64).reshape(m, nb, 32), w.reshape(-1, nb, 32)
    ).astype(np.float64)
    terms = dots * dw[None] * dx.astype(np.float64)[:, None, :]
    terms += mw[None] * (dx.astype(np.float64) * sx)[:, None, :]
    return terms.sum(axis=2), np.abs(terms).sum(axis=2)


# ---- random blocks --------------------------------------------------------------------------


def random_blocks(name: str, rows: int, cols: int, seed: int) -> RawBlocks:
    """Blocks of random bytes with finite random scales (and mins), as a file could hold them:
    any 4-bit, 6-bit or 8-bit value, -128 included, any 6-bit or int8 sub-block scale."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[name]
    nb = cols // fmt.block_size
    data = rng.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((rows, nb, 2)) * 0.02).astype(np.float16).view(np.uint8)
    if name == "Q6_K":
        data[:, :, 208:210] = scales[:, :, :2]  # d, at the end
    else:  # d (and the min, or dmin) first
        head = 4 if name in ("Q4_1", "Q4_K") else 2
        data[:, :, :head] = scales.reshape(rows, nb, 4)[:, :, :head]
    return RawBlocks(fmt, rows, cols, data.reshape(rows, -1))


def quantized_by_gguf(name: str, weight: np.ndarray) -> RawBlocks:
    qtype = GGMLQuantizationType[name]
    data = quants.quantize(weight.astype(np.float32), qtype)
    return RawBlocks(FORMATS[name], weight.shape[0], weight.shape[1], data)


def run(x: torch.Tensor, blocks: RawBlocks, ldy: int | None = None) -> torch.Tensor:
    out = torch.full((x.shape[0], ldy or blocks.rows), float("nan"))
    block_linear.linear_into(x, blocks, out[:, : blocks.rows])
    return out


# ---- tests ----------------------------------------------------------------------------------


def test_the_activations_are_quantized_bit_for_bit_as_the_reference_does(kernel):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=gen) * torch.tensor([1e-3, 1.0, 1e3, 7.0, 0.5])[:, None]
    x[1, 32:64] = 0.0  # a zero block: scale 0, values 0, no division by zero
    x[2, 5] = 12345.0  # one large value flattens its block
    q, d, s = block_linear.quantize_rows(x)
    want_q, want_d, want_s = reference_quantize_rows(x.numpy())
    assert np.array_equal(q.numpy(), want_q)
    assert np.array_equal(d.numpy(), want_d)
    assert np.array_equal(s.numpy(), want_s)
    assert float(d[1, 1]) == 0.0 and int(q[1, 32:64].abs().max()) == 0


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("rows", "cols"), [(4, 32), (13, 96), (37, 224), (64, 512)])
@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_the_kernel_matches_the_reference_on_random_blocks(kernel, name, rows, cols, batch):
    blocks = random_blocks(name, rows, cols, seed=rows * 31 + batch)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(rows + batch))
    got = run(x, blocks).numpy().astype(np.float64)
    want, magnitude = reference_linear(x.numpy(), blocks)
    assert np.all(np.abs(got - want) <= 1e-5 * magnitude + 1e-30), np.abs(got - want).max()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_strided_output_gets_only_its_columns(kernel, name):
    """Fused projections write each part into its columns of one output."""
    blocks = random_blocks(name, 10, 64, seed=5)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    out = run(x, blocks, ldy=25)
    assert torch.isnan(out[:, 10:]).all()  # untouched
    want, magnitude = reference_linear(x.numpy(), blocks)
    assert np.all(np.abs(out[:, :10].double().numpy() - want) <= 1e-5 * magnitude + 1e-30)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_the_gguf_package(kernel, name, dtype):
    blocks = random_blocks(name, 9, 128, seed=2)
    want = quants.dequantize(blocks.data, GGMLQuantizationType[name]).reshape(9, 128)
    got = block_linear.dequantize(blocks, dtype)
    assert got.dtype == dtype and got.shape == (9, 128)
    # Q4_1's d * q + m is one fused multiply-add here, two roundings in numpy: one ulp apart.
    expected = torch.from_numpy(want.astype(np.float32)).to(dtype)
    assert torch.allclose(got.float(), expected.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_quantized_weight_multiplies_close_to_its_float_original(kernel, name):
    """End to end with llama.cpp's own quantizer (the gguf package): the product is close to the
    float product, as far as the two quantizations allow."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(48, 256, generator=gen) * 0.05
    x = torch.randn(4, 256, generator=gen)
    blocks = quantized_by_gguf(name, weight.numpy())
    got = run(x, blocks)
    exact = x @ weight.T
    tolerance = {"Q8_0": 0.02, "Q4_0": 0.2, "Q4_1": 0.2}[name]
    assert float((got - exact).norm() / exact.norm()) < tolerance


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
def test_quantizing_at_load_makes_the_gguf_packages_blocks_bit_for_bit(kernel, name):
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(21, 160, generator=gen) * 0.03
    weight[0, :32] = 0.0  # an all-zero block
    weight[1, 40] = -5.0  # the largest magnitude negative: Q4_0's scale takes its sign
    weight[2, 64:96] = torch.linspace(-1, 1, 32)  # ties at the rounding edges
    got = block_linear.quantize(weight, name)
    want = quants.quantize(weight.numpy(), GGMLQuantizationType[name])
    assert got.format.name == name and (got.rows, got.cols) == (21, 160)
    assert np.array_equal(got.data, want)


# ---- the k-quants ---------------------------------------------------------------------------


def reference_kquant_linear(x: np.ndarray, blocks: RawBlocks) -> tuple[np.ndarray, np.ndarray]:
    """x @ W.T with x quantized as the kernel quantizes it and W as the gguf package dequantizes
    it, in float64; and the sum of the terms' magnitudes."""
    qx, dx, _ = reference_quantize_rows(x)
    m, k = x.shape
    xq = (qx.astype(np.float64).reshape(m, k // 32, 32) * dx[:, :, None]).reshape(m, k)
    qtype = GGMLQuantizationType[blocks.format.name]
    w = quants.dequantize(blocks.data, qtype).reshape(blocks.rows, k).astype(np.float64)
    return xq @ w.T, np.abs(xq) @ np.abs(w).T


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize(("rows", "cols"), [(4, 256), (13, 512), (37, 768)])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_kquant_kernel_matches_the_reference_on_random_blocks(kernel, name, rows, cols, batch):
    blocks = random_blocks(name, rows, cols, seed=rows * 7 + batch)
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(rows + 3 * batch))
    got = run(x, blocks).numpy().astype(np.float64)
    want, magnitude = reference_kquant_linear(x.numpy(), blocks)
    assert np.all(np.abs(got - want) <= 2e-5 * magnitude + 1e-30), np.abs(got - want).max()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kquant_dequantize_matches_the_gguf_package_bit_for_bit(kernel, name, dtype):
    blocks = random_blocks(name, 5, 512, seed=4)
    want = quants.dequantize(blocks.data, GGMLQuantizationType[name]).reshape(5, 512)
    got = block_linear.dequantize(blocks, dtype)
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)).to(dtype))


# ---- every format, in either layout ---------------------------------------------------------

PACKED = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
LAYOUTS = [(name, "file") for name in FORMATS] + [(name, "packed") for name in PACKED]


def in_layout(blocks: RawBlocks, layout: str) -> block_linear.AnyBlocks:
    return block_linear.pack(blocks) if layout == "packed" else blocks


@pytest.mark.parametrize(("name", "layout"), LAYOUTS)
def test_rows_do_not_depend_on_the_batch_or_the_threads(kernel, name, layout):
    """Batch invariance: a row's result is the same bits alone, in any batch, at any thread
    count (deterministic mode relies on it). 2,304 columns: K takes two passes (of 64 blocks);
    64 rows: the activations' quantizing is split over the threads too."""
    blocks = in_layout(random_blocks(name, 13, 2304, seed=9), layout)
    x = torch.randn(64, 2304, generator=torch.Generator().manual_seed(9))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([run(x[i : i + 1], blocks) for i in range(64)])
        torch.set_num_threads(2)
        together = run(x, blocks)
        pairs = torch.cat([run(x[i : i + 2], blocks) for i in range(0, 10, 2)])
        fives = torch.cat([run(x[i : i + 5], blocks) for i in range(0, 10, 5)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, together)
    assert torch.equal(alone[:10], pairs) and torch.equal(alone[:10], fives)


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize(("rows", "cols"), [(5, 256), (13, 2304), (64, 512)])
@pytest.mark.parametrize("batch", [1, 4, 9])
def test_the_packed_kernel_matches_the_reference(kernel, name, rows, cols, batch):
    """Rows not a multiple of the group of eight (zero padding rows never written), batches
    across the kernel's tiles of x rows, K across passes."""
    blocks = random_blocks(name, rows, cols, seed=rows * 5 + batch)
    packed = block_linear.pack(blocks)
    assert isinstance(packed, block_linear.PackedBlocks)
    # The file's bytes per block and row (Q4_K: 148, its sub-block scales unpacked to bytes),
    # rows padded to whole groups (of 8 or 16).
    per_block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 148, "Q6_K": 210}[name]
    group = block_linear._packed_library().radixlang_packed_group_rows()
    padded = -(-rows // group) * group
    assert packed.num_bytes == padded * cols // blocks.format.block_size * per_block
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(rows + batch))
    got = run(x, packed).numpy().astype(np.float64)
    reference = reference_kquant_linear if name in ("Q4_K", "Q6_K") else reference_linear
    want, magnitude = reference(x.numpy(), blocks)
    assert np.all(np.abs(got - want) <= 2e-5 * magnitude + 1e-30), np.abs(got - want).max()


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("batch", [1, 5, 70, 130])
def test_bfloat16_rows_give_the_float32_call_rounded(kernel, name, batch):
    """Packed blocks take bfloat16 x and out: the float32 call's results rounded to nearest
    even, bit for bit, into a strided view; the file's layout refuses them. 130 rows of 512
    are widened on every thread."""
    blocks = random_blocks(name, 21, 512, seed=batch)
    packed = block_linear.pack(blocks)
    x = torch.randn(batch, 512, generator=torch.Generator().manual_seed(batch)).to(torch.bfloat16)
    want = torch.empty(batch, 21)
    block_linear.linear_into(x.float(), packed, want)
    wide = torch.zeros(batch, 30, dtype=torch.bfloat16)
    block_linear.linear_into(x, packed, wide[:, 4:25])
    assert torch.equal(wide[:, 4:25], want.to(torch.bfloat16))
    assert not wide[:, :4].any() and not wide[:, 25:].any()
    with pytest.raises(block_linear.BlockKernelError, match="packed"):
        block_linear.linear_into(x, blocks, torch.empty(batch, 21, dtype=torch.bfloat16))
    with pytest.raises(block_linear.BlockKernelError, match="both"):
        block_linear.linear_into(x, packed, torch.empty(batch, 21))


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_keeps_every_value(kernel, name, dtype):
    blocks = random_blocks(name, 13, 512, seed=12)
    packed = block_linear.pack(blocks)
    assert torch.equal(
        block_linear.dequantize(packed, dtype), block_linear.dequantize(blocks, dtype)
    )


def test_the_packed_kernel_gives_the_same_bits_on_every_build(monkeypatch):
    """Each lane does in vector code what the scalar code does for its row, so the AVX-512,
    AVX2 and scalar builds agree bit for bit (not only within a tolerance)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 targets")
    x = torch.randn(6, 2304, generator=torch.Generator().manual_seed(4))
    results = {}
    try:
        for march in MARCHES:
            monkeypatch.setenv("RADIXLANG_NATIVE_MARCH", "" if march == "native" else march)
            clear_libraries()
            if reason := native_build.skip_reason(block_linear._packed_library):
                pytest.skip(reason)
            results[march] = [
                run(x, block_linear.pack(random_blocks(name, 13, 2304, seed=3))) for name in PACKED
            ]
    finally:
        clear_libraries()
    for march in MARCHES[1:]:
        for name, a, b in zip(PACKED, results["native"], results[march], strict=True):
            assert torch.equal(a, b), (name, march)
