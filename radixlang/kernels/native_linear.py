"""Weight-only int8 linears on CPUs: the C++ kernel of ``native/int8_linear.cpp``.

Weights are quantized once (one float scale per output row, symmetric, 127 levels) and packed
into the kernel's panels; activations stay float32. A decode step's matmuls read the weights
once per step, so a quarter of the bytes is most of the gain at small batches.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from radixlang.kernels import native_build


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_build.load("int8_linear")
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.radixlang_int8_pack.argtypes = [p, i64, i64, p]
    lib.radixlang_int8_pack.restype = None
    lib.radixlang_int8_linear.argtypes = [p, i64, i64, p, i64, p, p, p, i]
    lib.radixlang_int8_linear.restype = None
    return lib


@functools.cache
def available() -> bool:
    """Whether the int8 kernel builds and loads here (``RADIXLANG_NATIVE=0`` turns it off)."""
    return native_build.usable(_library, "native int8 linear")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as int8 and its float32 per-row scales (``w ≈ q * scale``)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight in the kernel's panel layout, with its scales and optional bias."""

    packed: torch.Tensor  # int8, ceil(out / panel) * panel * in bytes
    scales: torch.Tensor  # [out] float32
    bias: torch.Tensor | None  # [out] float32
    out_features: int
    in_features: int


def pack(q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> PackedInt8:
    lib = _library()
    n, k = q.shape
    panel = lib.radixlang_int8_panel()
    packed = torch.empty(-(-n // panel) * panel * k, dtype=torch.int8)
    q = q.contiguous()
    lib.radixlang_int8_pack(q.data_ptr(), n, k, packed.data_ptr())
    b = None if bias is None else bias.detach().float().contiguous()
    return PackedInt8(packed, scales.float().contiguous(), b, n, k)


def linear(x: torch.Tensor, weight: PackedInt8) -> torch.Tensor:
    """``x`` ``[..., in]`` (any float dtype) times the int8 weight; float32 out."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.in_features).float().contiguous()
    y = torch.empty(x2.shape[0], weight.out_features, dtype=torch.float32)
    _library().radixlang_int8_linear(
        x2.data_ptr(),
        x2.shape[0],
        weight.in_features,
        weight.packed.data_ptr(),
        weight.out_features,
        weight.scales.data_ptr(),
        0 if weight.bias is None else weight.bias.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y.view(*lead, weight.out_features)
