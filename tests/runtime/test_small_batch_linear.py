"""A small model's bfloat16 linears on CPUs with AVX-512 BF16 and no AMX: batches of up to
SMALL_BATCH_ROWS rows take the invariant kernel's packing, larger ones oneDNN's."""

from __future__ import annotations

import pytest
import torch

from radixlang.kernels import invariant_linear
from radixlang.runtime.models import linear
from radixlang.runtime.models.linear import SMALL_BATCH_ROWS, Linear, small_batch_kernel

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16\n"
SAPPHIRE_RAPIDS = ZEN4.replace("avx512_bf16", "avx512_bf16 amx_bf16 amx_tile")
AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_the_policy_takes_small_bfloat16_models_on_cpus_without_amx(monkeypatch):
    monkeypatch.setattr(invariant_linear, "available", lambda: True)
    small = 300 * 2**20
    assert small_batch_kernel(torch.bfloat16, small, ZEN4)
    assert not small_batch_kernel(torch.bfloat16, small, SAPPHIRE_RAPIDS)  # AMX: oneDNN wins
    assert not small_batch_kernel(torch.bfloat16, small, AVX2_ONLY)  # no bfloat16 dot pairs
    assert not small_batch_kernel(torch.float32, small, ZEN4)
    assert not small_batch_kernel(torch.bfloat16, linear.SMALL_BATCH_MODEL_BYTES + 1, ZEN4)
    monkeypatch.setenv(linear.SMALL_BATCH_ENV, "0")
    assert not small_batch_kernel(torch.bfloat16, small, ZEN4)
    monkeypatch.delenv(linear.SMALL_BATCH_ENV)
    monkeypatch.setattr(invariant_linear, "available", lambda: False)
    assert not small_batch_kernel(torch.bfloat16, small, ZEN4)


@pytest.mark.skipif(not invariant_linear.available(), reason="the invariant kernel did not build")
def test_small_batches_take_the_invariant_kernel_and_large_ones_the_plain_path():
    torch.manual_seed(0)
    weight = (torch.randn(80, 96) * 0.1).to(torch.bfloat16)
    bias = torch.randn(80).to(torch.bfloat16)
    plain, both = Linear(weight, bias), Linear(weight, bias, small_batch=True)
    packed = invariant_linear.pack(weight, bias)
    assert both.num_bytes > plain.num_bytes  # the second packing is counted
    for rows in (1, 3, SMALL_BATCH_ROWS):
        x = torch.randn(rows, 96).to(torch.bfloat16)
        assert torch.equal(both(x), invariant_linear.linear(x, packed))
        torch.testing.assert_close(both(x).float(), plain(x).float(), atol=3e-2, rtol=2e-2)
    x = torch.randn(SMALL_BATCH_ROWS + 1, 96).to(torch.bfloat16)
    assert torch.equal(both(x), plain(x))
