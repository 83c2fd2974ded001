"""Weight-only int8 linears: the C++ kernel against the dequantized float64 product."""

import pytest
import torch

from radixlang.kernels import native_build, native_linear
from radixlang.runtime.models.linear import Int8Linear, Linear, make_linear


@pytest.fixture(scope="module", autouse=True)
def native_kernel():
    """Skip where no C++ compiler is found; a failed build fails with the compiler's message."""
    if reason := native_build.skip_reason(native_linear._library):
        pytest.skip(reason)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    q, scales = native_linear.quantize_rows(weight)
    return q.double() * scales.double()[:, None]


def test_quantize_rows_round_trips_within_half_a_step():
    w = torch.randn(37, 50)
    q, scales = native_linear.quantize_rows(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    step = scales[:, None]
    assert bool(((q.float() * step - w).abs() <= step / 2 + 1e-7).all())
    zero_row = native_linear.quantize_rows(torch.zeros(2, 5))[0]
    assert int(zero_row.abs().max()) == 0  # no division by zero


# Shapes off every tile size: rows not a multiple of the 16-row panel, batches through the
# direct (<= 4) and the widened-panel (6-row tiles) paths with tails.
@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (37, 50), (3, 7), (130, 96)])
@pytest.mark.parametrize("batch", [1, 2, 4, 5, 6, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_int8_matches_the_dequantized_product(out_features, in_features, batch, with_bias):
    gen = torch.Generator().manual_seed(out_features * 100 + batch)
    w = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(batch, in_features, generator=gen)
    want = x.double() @ dequantized(w).T + (0 if bias is None else bias.double())
    got = Int8Linear(w, bias)(x)
    assert got.dtype == torch.float32 and got.shape == (batch, out_features)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_leading_dimensions_and_16_bit_inputs():
    w = torch.randn(20, 32)
    layer = Int8Linear(w)
    x = torch.randn(2, 3, 32)
    out = layer(x)
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out.double(), x.double() @ dequantized(w).T, atol=1e-4, rtol=1e-5)
    half = layer(x.bfloat16())
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), layer(x.bfloat16().float()), atol=2e-2, rtol=2e-2)


def test_the_torch_fallback_computes_the_same(monkeypatch):
    w, bias = torch.randn(24, 40), torch.randn(24)
    x = torch.randn(5, 40)
    native = Int8Linear(w, bias)
    monkeypatch.setattr(native_linear, "available", lambda: False)
    fallback = Int8Linear(w, bias)
    assert fallback.packed is None and native.packed is not None
    torch.testing.assert_close(fallback(x), native(x), atol=1e-4, rtol=1e-5)


def test_int8_holds_a_quarter_of_the_float32_bytes():
    w = torch.randn(64, 128)
    assert Int8Linear(w).num_bytes == 64 * 128 + 64 * 4
    assert Linear(w).num_bytes == 64 * 128 * 4


def test_make_linear_names_the_choices():
    w = torch.randn(4, 4)
    assert isinstance(make_linear(w), Linear)
    assert isinstance(make_linear(w, quantization="int8"), Int8Linear)
    with pytest.raises(ValueError, match="none, int8"):
        make_linear(w, quantization="int4")
