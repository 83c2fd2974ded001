"""Linears on GGUF's quantized blocks in place: the 32-element ones (Q4_0, Q4_1, Q8_0:
``native/block32_linear.cpp``) and the k-quants' 256-element super-blocks (Q4_K, Q6_K:
``native/kquant_linear.cpp``).

The weights stay the bytes they came as (``RawBlocks``; a memory map's pages when loaded from a
file), so a model takes its file's size in memory, not four to eight times that. Small batches
(decode) multiply straight from the blocks, with the activations quantized per 32-element block
to int8; large ones (prefill) dequantize the weight to the activations' dtype and multiply in
torch, whose GEMMs are faster there than integer dots one pair at a time. The block kernel's rows
do not depend on the batch, so deterministic mode uses it at every size.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import torch

from radixlang.kernels import native_build
from radixlang.kernels.block_formats import FORMATS, RawBlocks

# At this many rows of x or more, dequantize-and-GEMM takes over from the integer dots, whose
# cost grows with every row (a first choice: the crossover is still to be measured).
GEMM_MIN_ROWS = 16


class BlockKernelError(RuntimeError):
    """The native block kernel is not usable here, or was handed something it does not take."""


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native_build.load("block32_linear")
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.radixlang_block32_bytes.argtypes = [i]
    lib.radixlang_block32_bytes.restype = i
    lib.radixlang_block32_linear.argtypes = [i, p, i64, i64, i64, p, i64, p, i64, i]
    lib.radixlang_block32_linear.restype = i
    lib.radixlang_block32_quantize_rows.argtypes = [p, i64, i64, p, p, p]
    lib.radixlang_block32_quantize_rows.restype = None
    lib.radixlang_block32_dequantize.argtypes = [i, p, i64, i64, i64, p, i, i]
    lib.radixlang_block32_dequantize.restype = i
    lib.radixlang_block32_quantize.argtypes = [i, p, i64, i64, p, i]
    lib.radixlang_block32_quantize.restype = i
    return lib


@functools.cache
def _kquant_library() -> ctypes.CDLL:
    lib = native_build.load("kquant_linear")
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.radixlang_kquant_bytes.argtypes = [i]
    lib.radixlang_kquant_bytes.restype = i
    lib.radixlang_kquant_linear.argtypes = [i, p, i64, i64, i64, p, i64, p, i64, i]
    lib.radixlang_kquant_linear.restype = i
    lib.radixlang_kquant_dequantize.argtypes = [i, p, i64, i64, i64, p, i, i]
    lib.radixlang_kquant_dequantize.restype = i
    return lib


@functools.cache
def available() -> bool:
    """Whether the block kernels build and load here (``RADIXLANG_NATIVE=0`` turns them off)."""
    return native_build.usable(_library, "native block linear") and native_build.usable(
        _kquant_library, "native k-quant linear"
    )


def _door(blocks: RawBlocks) -> tuple[Any, str]:
    """The library multiplying ``blocks``' format, and its functions' prefix."""
    if blocks.format.block_size == 256:
        return _kquant_library(), "radixlang_kquant"
    return _library(), "radixlang_block32"


def takes(blocks: RawBlocks) -> bool:
    """Whether the kernels multiply ``blocks``' format."""
    lib, prefix = _door(blocks)
    bytes_of = getattr(lib, f"{prefix}_bytes")
    return bytes_of(blocks.format.ggml_type) == blocks.format.block_bytes


def _pointer(array: np.ndarray) -> int:
    if not array.flags.c_contiguous:
        raise BlockKernelError("block data must be C-contiguous")
    return array.ctypes.data


def linear_into(x: torch.Tensor, blocks: RawBlocks, out: torch.Tensor) -> None:
    """``out[:, :] = x @ W.T`` for ``x`` float32 ``[m, k]`` (contiguous) and ``out`` a float32
    ``[m, n]`` view whose rows may be strided (a slice of a wider output's columns)."""
    m, k = x.shape
    if k != blocks.cols or out.shape != (m, blocks.rows) or out.stride(1) != 1:
        raise BlockKernelError(
            f"x {list(x.shape)} and out {list(out.shape)} do not fit a "
            f"[{blocks.rows}, {blocks.cols}] weight"
        )
    lib, prefix = _door(blocks)
    status = getattr(lib, f"{prefix}_linear")(
        blocks.format.ggml_type,
        _pointer(blocks.data),
        blocks.rows,
        k,
        blocks.data.strides[0],
        x.data_ptr(),
        m,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status != 0:
        raise BlockKernelError(f"the block kernel does not take {blocks.format.name}")


def dequantize(blocks: RawBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a ``[rows, cols]`` tensor of ``dtype`` (float32 or bfloat16 natively;
    other dtypes through float32)."""
    native = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty(blocks.rows, blocks.cols, dtype=native)
    lib, prefix = _door(blocks)
    status = getattr(lib, f"{prefix}_dequantize")(
        blocks.format.ggml_type,
        _pointer(blocks.data),
        blocks.rows,
        blocks.cols,
        blocks.data.strides[0],
        out.data_ptr(),
        1 if native == torch.bfloat16 else 0,
        torch.get_num_threads(),
    )
    if status != 0:
        raise BlockKernelError(f"the block kernel does not take {blocks.format.name}")
    return out if native == dtype else out.to(dtype)


def quantize(weight: torch.Tensor, format_name: str) -> RawBlocks:
    """A float weight ``[rows, cols]`` (cols a multiple of 32) as ``format_name`` blocks (Q8_0 or
    Q4_0), as llama.cpp's quantizer makes them: quantization at load for models that come as
    floats."""
    fmt = FORMATS[format_name]
    w = weight.detach().float().contiguous()
    rows, cols = w.shape
    out = np.empty((rows, fmt.row_bytes(cols)), dtype=np.uint8)
    status = _library().radixlang_block32_quantize(
        fmt.ggml_type, w.data_ptr(), rows, cols, out.ctypes.data, torch.get_num_threads()
    )
    if status != 0:
        raise BlockKernelError(f"the block kernel does not quantize to {format_name}")
    return RawBlocks(fmt, rows, cols, out)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` float32 ``[m, k]`` as the kernel quantizes it: int8 values ``[m, k]``, float32
    scales and int32 sums of the values ``[m, k / 32]`` (for tests against a reference)."""
    x = x.float().contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    s = torch.empty(m, k // 32, dtype=torch.int32)
    _library().radixlang_block32_quantize_rows(
        x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr()
    )
    return q, d, s
