"""Linears on GGUF's quantized blocks: the file's own layout read in place (the 32-element
formats Q4_0, Q4_1, Q8_0: ``native/block32_linear.cpp``; the k-quants' 256-element super-blocks
Q4_K, Q6_K: ``native/kquant_linear.cpp``), or repacked once at load with eight rows interleaved
per block (``PackedBlocks``: all five; ``native/packed_linear.cpp``), where one
integer dot instruction serves 8 or 16 rows and the float work per (row, block) pair falls as
much.

Either way a model takes its file's size in memory, not four to eight times that, and the
activations are quantized per 32-element block to int8. Each kernel's rows do not depend on the
batch, so deterministic mode uses it at every size.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixlang.kernels import native_build
from radixlang.kernels.block_formats import FORMATS, BlockFormat, RawBlocks

# Where torch's GEMM outruns the integer dots (bfloat16 on AMX tiles: models/block_linear.py),
# batches of this many rows or more dequantize and take it (not measured here: no AMX machine).
GEMM_MIN_ROWS = 16


class BlockKernelError(RuntimeError):
    """The native block kernel is not usable here, or was handed something it does not take."""


def _bind(name: str, prefix: str, signatures: dict[str, tuple[list[Any], Any]]) -> ctypes.CDLL:
    lib = native_build.load(name)
    for fn, (argtypes, restype) in signatures.items():
        getattr(lib, f"{prefix}_{fn}").argtypes = argtypes
        getattr(lib, f"{prefix}_{fn}").restype = restype
    return lib


_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# The raw-layout kernels' shared doors: bytes of a block, y = x @ W.T, W as floats.
_RAW_DOORS: dict[str, tuple[list[Any], Any]] = {
    "bytes": ([_I], _I),
    "linear": ([_I, _P, _I64, _I64, _I64, _P, _I64, _P, _I64, _I], _I),
    "dequantize": ([_I, _P, _I64, _I64, _I64, _P, _I, _I], _I),
}


@functools.cache
def _library() -> ctypes.CDLL:
    return _bind(
        "block32_linear",
        "radixlang_block32",
        {
            **_RAW_DOORS,
            "quantize_rows": ([_P, _I64, _I64, _P, _P, _P], None),
            "quantize": ([_I, _P, _I64, _I64, _P, _I], _I),
        },
    )


@functools.cache
def _kquant_library() -> ctypes.CDLL:
    return _bind("kquant_linear", "radixlang_kquant", _RAW_DOORS)


@functools.cache
def _packed_library() -> ctypes.CDLL:
    return _bind(
        "packed_linear",
        "radixlang_packed",
        {
            "group_rows": ([], _I),
            "group_bytes": ([_I, _I64], _I64),
            "pack": ([_I, _P, _I64, _I64, _I64, _P, _I], _I),
            "linear": ([_I, _P, _I64, _I64, _P, _I64, _P, _I64, _I], _I),
            "linear_bf16": ([_I, _P, _I64, _I64, _P, _I64, _P, _I64, _I], _I),
            "dequantize": ([_I, _P, _I64, _I64, _P, _I, _I], _I),
        },
    )


@functools.cache
def available() -> bool:
    """Whether the block kernels build and load here (``RADIXLANG_NATIVE=0`` turns them off)."""
    return (
        native_build.usable(_library, "native block linear")
        and native_build.usable(_kquant_library, "native k-quant linear")
        and native_build.usable(_packed_library, "native packed block linear")
    )


@dataclass(frozen=True)
class PackedBlocks:
    """A quantized matrix ``[rows, cols]`` repacked for ``native/packed_linear.cpp``: ``data`` is
    ``uint8 [ceil(rows / G), group_bytes]``, G rows interleaved block by block (G = 16 where
    the kernel is built for AVX-512, 8 elsewhere; the last group padded with zero rows). Made
    by ``pack``."""

    format: BlockFormat
    rows: int
    cols: int
    data: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.data.nbytes)


def packs(blocks: RawBlocks) -> bool:
    """Whether ``pack`` repacks ``blocks``' format (the others stay in the file's layout)."""
    lib = _packed_library()
    return lib.radixlang_packed_group_bytes(blocks.format.ggml_type, blocks.cols) > 0


def pack(blocks: RawBlocks) -> PackedBlocks:
    """``blocks`` repacked with G rows interleaved per block (a copy of the same size; the
    source, often a memory map, is only read)."""
    lib = _packed_library()
    group_bytes = lib.radixlang_packed_group_bytes(blocks.format.ggml_type, blocks.cols)
    if group_bytes <= 0:
        raise BlockKernelError(f"{blocks.format.name} blocks are not packed")
    groups = -(-blocks.rows // lib.radixlang_packed_group_rows())
    out = np.empty((groups, group_bytes), dtype=np.uint8)
    lib.radixlang_packed_pack(
        blocks.format.ggml_type,
        _pointer(blocks.data),
        blocks.rows,
        blocks.cols,
        blocks.data.strides[0],
        out.ctypes.data,
        torch.get_num_threads(),
    )
    return PackedBlocks(blocks.format, blocks.rows, blocks.cols, out)


AnyBlocks = RawBlocks | PackedBlocks


def _door(blocks: RawBlocks) -> tuple[Any, str]:
    """The library multiplying ``blocks``' format in the file's layout, and its prefix."""
    if blocks.format.block_size == 256:
        return _kquant_library(), "radixlang_kquant"
    return _library(), "radixlang_block32"


def takes(blocks: RawBlocks) -> bool:
    """Whether the kernels multiply ``blocks``' format."""
    lib, prefix = _door(blocks)
    bytes_of = getattr(lib, f"{prefix}_bytes")
    return bytes_of(blocks.format.ggml_type) == blocks.format.block_bytes


def _call(blocks: AnyBlocks, fn: str, *tail: Any) -> None:
    """The kernel function ``fn`` of ``blocks``' layout and format on ``(format, data, rows,
    cols[, row stride]) + tail``; the file's layout passes its rows' stride too."""
    head = (blocks.format.ggml_type, _pointer(blocks.data), blocks.rows, blocks.cols)
    if isinstance(blocks, PackedBlocks):
        status = getattr(_packed_library(), f"radixlang_packed_{fn}")(*head, *tail)
    else:
        lib, prefix = _door(blocks)
        status = getattr(lib, f"{prefix}_{fn}")(*head, blocks.data.strides[0], *tail)
    if status != 0:
        raise BlockKernelError(f"the block kernel does not take {blocks.format.name}")


def _pointer(array: np.ndarray) -> int:
    if not array.flags.c_contiguous:
        raise BlockKernelError("block data must be C-contiguous")
    return array.ctypes.data


def linear_into(x: torch.Tensor, blocks: AnyBlocks, out: torch.Tensor) -> None:
    """``out[:, :] = x @ W.T`` for ``x`` ``[m, k]`` (contiguous) and ``out`` an ``[m, n]`` view
    whose rows may be strided (a slice of a wider output's columns): both float32, or for
    packed blocks both bfloat16 (the same products, converted in the kernel)."""
    m, k = x.shape
    if k != blocks.cols or out.shape != (m, blocks.rows) or out.stride(1) != 1:
        raise BlockKernelError(
            f"x {list(x.shape)} and out {list(out.shape)} do not fit a "
            f"[{blocks.rows}, {blocks.cols}] weight"
        )
    fn = "linear"
    if x.dtype == torch.bfloat16 and out.dtype == torch.bfloat16:
        if not isinstance(blocks, PackedBlocks):
            raise BlockKernelError("bfloat16 activations need packed blocks")
        fn = "linear_bf16"
    elif x.dtype != torch.float32 or out.dtype != torch.float32:
        raise BlockKernelError(f"x {x.dtype} and out {out.dtype}: float32 or bfloat16 both")
    _call(blocks, fn, x.data_ptr(), m, out.data_ptr(), out.stride(0), torch.get_num_threads())


def dequantize(blocks: AnyBlocks, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as a ``[rows, cols]`` tensor of ``dtype`` (float32 or bfloat16 natively;
    other dtypes through float32)."""
    native = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty(blocks.rows, blocks.cols, dtype=native)
    dtype_code = 1 if native == torch.bfloat16 else 0
    _call(blocks, "dequantize", out.data_ptr(), dtype_code, torch.get_num_threads())
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
