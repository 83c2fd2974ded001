"""The native residual add + RMSNorm (kernels/rms_norm.py) against torch's ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlang.kernels import native_build, rms_norm


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    if reason := native_build.skip_reason(rms_norm._library):
        pytest.skip(reason)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "cols"), [(1, 576), (8, 2048), (300, 2048), (3, 7)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_it_rounds_as_torch_does(dtype, rows, cols, with_delta):
    """The residual sum bit for bit as torch's add; the norm as F.rms_norm's but for the rare
    element whose sum of squares rounds otherwise."""
    gen = torch.Generator().manual_seed(rows * cols)
    residual = torch.randn(rows, cols, generator=gen).to(dtype)
    delta = torch.randn(rows, cols, generator=gen).to(dtype) if with_delta else None
    weight = (1 + 0.1 * torch.randn(cols, generator=gen)).to(dtype)
    want_residual = residual + delta if delta is not None else residual.clone()
    want = F.rms_norm(want_residual, weight.shape, weight, 1e-5)
    got = rms_norm.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(residual, want_residual)  # updated in place
    assert got.dtype == dtype and got.shape == want.shape
    assert (got != want).float().mean().item() < 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


def test_each_row_gets_the_same_bits_at_every_batch_size():
    gen = torch.Generator().manual_seed(1)
    residual = torch.randn(200, 1024, generator=gen).to(torch.bfloat16)
    delta = torch.randn(200, 1024, generator=gen).to(torch.bfloat16)
    weight = torch.randn(1024, generator=gen).to(torch.bfloat16)
    whole = rms_norm.add_rms_norm(residual.clone(), delta, weight, 1e-6)
    for rows in (1, 7, 64):  # few rows run on one thread, 200 on every thread
        part = rms_norm.add_rms_norm(residual[:rows].clone(), delta[:rows], weight, 1e-6)
        assert torch.equal(part, whole[:rows])


def test_other_inputs_take_torch_and_still_add_in_place():
    residual, delta, weight = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    want_residual = residual + delta  # float32: torch's ops
    got = rms_norm.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(residual, want_residual)
    assert torch.equal(got, F.rms_norm(want_residual, (16,), weight, 1e-5))
    strided = torch.randn(16, 4).to(torch.bfloat16).t()  # not contiguous: torch's ops
    w = torch.ones(16, dtype=torch.bfloat16)
    want = F.rms_norm(strided, (16,), w, 1e-5)
    assert torch.equal(rms_norm.add_rms_norm(strided, None, w, 1e-5), want)


def test_native_false_is_torchs_ops_bit_for_bit():
    """What deterministic mode asks for: F.rms_norm's bits, the residual still added."""
    gen = torch.Generator().manual_seed(3)
    residual = torch.randn(300, 2048, generator=gen).to(torch.bfloat16)
    delta = torch.randn(300, 2048, generator=gen).to(torch.bfloat16)
    weight = torch.randn(2048, generator=gen).to(torch.bfloat16)
    want_residual = residual + delta
    got = rms_norm.add_rms_norm(residual, delta, weight, 1e-5, native=False)
    assert torch.equal(residual, want_residual)
    assert torch.equal(got, F.rms_norm(want_residual, (2048,), weight, 1e-5))
