"""Batch-invariant linear layers on CPUs: the C++ kernel of ``native/invariant_linear.cpp``.

``linear(x, packed)`` gives every row of ``x`` bitwise the same result whatever the other rows,
their number, or the thread count (see the C++ file for why oneDNN and BLAS do not). Weights
are packed once; on CPUs with AVX-512 BF16 a bfloat16 weight is packed in k pairs for the
CPU's bfloat16 dot product, elsewhere every dtype is widened to float32 as it is read.

Where the kernel does not build, :func:`rowwise_linear` is the torch fallback: one row at a
time through the same ``[1, in]`` buffer, so every row is the same matmul call (slow, but
invariant by construction).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from radixlang.kernels import native_build

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
PLAIN, PAIRS = 0, 1


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_build.load("invariant_linear")
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.radixlang_invariant_pack.argtypes = [p, i, i64, i64, i, p]
    lib.radixlang_invariant_pack.restype = i
    lib.radixlang_invariant_linear.argtypes = [p, i64, i64, i64, p, i, i, i64, p, p, i, i]
    lib.radixlang_invariant_linear.restype = i
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here (``RADIXLANG_NATIVE=0`` turns it off)."""
    return native_build.usable(_library, "native batch-invariant linear")


@dataclass(frozen=True)
class PackedWeight:
    """A weight in the kernel's panel layout, with its optional float32 bias."""

    packed: torch.Tensor
    layout: int  # PLAIN or PAIRS
    dtype: torch.dtype  # the weight's (and the outputs') dtype
    bias: torch.Tensor | None
    out_features: int
    in_features: int


def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """``weight`` ``[out, in]`` (float32, bfloat16 or float16, on the CPU) packed for
    :func:`linear`."""
    if weight.device.type != "cpu" or weight.dtype not in DTYPE_CODES:
        raise ValueError(f"the invariant linear takes CPU float weights; got {weight.dtype}")
    lib = _library()
    n, k = weight.shape
    panel = lib.radixlang_invariant_panel()
    pairs = weight.dtype == torch.bfloat16 and lib.radixlang_invariant_has_pairs()
    layout = PAIRS if pairs else PLAIN
    k_rows = -(-k // 2) * 2 if layout == PAIRS else k
    packed = torch.empty(-(-n // panel) * panel * k_rows, dtype=weight.dtype)
    w = weight.detach().contiguous()
    code = lib.radixlang_invariant_pack(
        w.data_ptr(), DTYPE_CODES[w.dtype], n, k, layout, packed.data_ptr()
    )
    if code != 0:
        raise ValueError(f"the invariant linear cannot pack a {w.dtype} weight in layout {layout}")
    b = None if bias is None else bias.detach().float().contiguous()
    return PackedWeight(packed, layout, weight.dtype, b, n, k)


def linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x`` ``[..., in]`` times the packed weight (+ bias), in the weight's dtype."""
    lead = x.shape[:-1]
    k = weight.in_features
    rows = x.reshape(-1, k)
    if weight.layout == PAIRS:
        rows = rows.to(torch.bfloat16)
        if k % 2:  # the last pair's second half is zero, in x as in the packed weight
            rows = torch.nn.functional.pad(rows, (0, 1))
    else:
        rows = rows.float()
    rows = rows.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, weight.out_features, dtype=weight.dtype)
    if m:
        _library().radixlang_invariant_linear(
            rows.data_ptr(),
            rows.shape[1],
            m,
            k,
            weight.packed.data_ptr(),
            weight.layout,
            DTYPE_CODES[weight.dtype],
            weight.out_features,
            0 if weight.bias is None else weight.bias.data_ptr(),
            y.data_ptr(),
            DTYPE_CODES[weight.dtype],
            torch.get_num_threads(),
        )
    return y.view(*lead, weight.out_features)


def rowwise_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` one row at a time through one ``[1, in]`` buffer: the same call, shape and
    alignment for every row, so a row's result cannot depend on the others."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    buffer = torch.empty(1, rows.shape[1], dtype=x.dtype, device=x.device)
    for i in range(rows.shape[0]):
        buffer.copy_(rows[i : i + 1])
        out[i : i + 1] = torch.nn.functional.linear(buffer, weight, bias)
    return out.view(*lead, weight.shape[0])
