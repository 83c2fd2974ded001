"""RMSNorm after a residual add, in one native call on CPUs (``native/rms_norm.cpp``).

The decoder adds each branch's output to the residual stream and normalizes the sum: torch
takes about ten ops for that, which at decode's few rows cost more than the arithmetic (35 us
against 17 for a bfloat16 row of 2,048 on a Zen 4). The native kernel takes bfloat16 and
float16 rows and rounds as torch does (see the C++ file: its results differ from torch's in a
handful of elements in 10^5, where the sum of squares rounds otherwise); float32 rows, where
such a difference would show in most elements, GPUs, other layouts and builds without the
kernel take torch's ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from radixlang.kernels import native_build

DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2}  # radixlang::Dtype


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_build.load("rms_norm")
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.radixlang_rms_norm.argtypes = [p, p, p, p, i, i64, i64, ctypes.c_float, i]
    lib.radixlang_rms_norm.restype = i
    return lib


@functools.cache
def available() -> bool:
    """Whether the kernel builds and loads here (``RADIXLANG_NATIVE=0`` turns it off)."""
    return native_build.usable(_library, "native RMSNorm")


def _native(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> bool:
    tensors = [residual, weight] + ([] if delta is None else [delta])
    return (
        residual.device.type == "cpu"
        and residual.dim() == 2
        and residual.dtype in DTYPE_CODES
        and all(t.dtype == residual.dtype and t.is_contiguous() for t in tensors)
        and (delta is None or delta.shape == residual.shape)
        and weight.shape == (residual.shape[1],)
        and available()
    )


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    native: bool = True,
) -> torch.Tensor:
    """``residual += delta`` (in place; skipped for None), then the RMSNorm of ``residual``
    times ``weight``: ``[rows, cols]`` rows, ``weight`` ``[cols]``. ``native=False``: torch's
    ops, bit for bit F.rms_norm."""
    if not (native and _native(residual, delta, weight)):
        if delta is not None:
            residual.add_(delta)
        return F.rms_norm(residual, weight.shape, weight, eps)
    out = torch.empty_like(residual)
    rows, cols = residual.shape
    _library().radixlang_rms_norm(
        residual.data_ptr(),
        None if delta is None else delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        DTYPE_CODES[residual.dtype],
        rows,
        cols,
        eps,
        torch.get_num_threads(),
    )
    return out
