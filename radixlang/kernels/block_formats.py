"""Quantized weight storage types: GGUF's block formats, as the kernels take them.

A quantized matrix ``[rows, cols]`` is stored row by row; each row is ``cols / block_size``
blocks of ``block_bytes`` bytes, in GGUF's own byte layout (``RawBlocks``). The kernels repack
those bytes once at load (``kernels/block_linear.py``); nothing is dequantized to a file.

This module imports neither torch nor the kernels, so model readers can use it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockFormat:
    """One storage type: its GGUF name and type id, elements and bytes per block."""

    name: str
    ggml_type: int
    block_size: int
    block_bytes: int

    def row_bytes(self, cols: int) -> int:
        if cols % self.block_size:
            raise ValueError(
                f"{self.name} rows hold whole blocks of {self.block_size}; got {cols} columns"
            )
        return cols // self.block_size * self.block_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_size


# The types the native kernels multiply directly (ids from ggml's enum, as GGUF stores them).
FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("Q4_0", 2, 32, 18),  # f16 scale, 32 x 4-bit (value = (q - 8) * d)
        BlockFormat("Q4_1", 3, 32, 20),  # f16 scale, f16 min, 32 x 4-bit (q * d + m)
        BlockFormat("Q8_0", 8, 32, 34),  # f16 scale, 32 x int8 (q * d)
        # Super-blocks of 256 (llama.cpp's k-quants; Q4_K_M mixes these two):
        BlockFormat("Q4_K", 12, 256, 144),  # d, dmin, 6-bit scales and mins per 32, 4-bit
        BlockFormat("Q6_K", 14, 256, 210),  # 6-bit values, an int8 scale per 16, d
    )
}
BY_GGML_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in FORMATS.values()}


@dataclass(frozen=True)
class RawBlocks:
    """A quantized matrix ``[rows, cols]`` as GGUF stores it: ``data`` is ``uint8``
    ``[rows, row_bytes]`` (often a view of a memory-mapped file)."""

    format: BlockFormat
    rows: int
    cols: int
    data: np.ndarray

    def __post_init__(self) -> None:
        want = (self.rows, self.format.row_bytes(self.cols))
        if self.data.dtype != np.uint8 or tuple(self.data.shape) != want:
            raise ValueError(
                f"{self.format.name} blocks of a [{self.rows}, {self.cols}] matrix are uint8 "
                f"{list(want)}; got {self.data.dtype} {list(self.data.shape)}"
            )

    @property
    def num_bytes(self) -> int:
        return self.rows * self.format.row_bytes(self.cols)

    def take_rows(self, order: np.ndarray) -> RawBlocks:
        """The rows in ``order`` (a permutation or a selection; blocks run along rows, so a
        row is moved whole)."""
        return RawBlocks(self.format, len(order), self.cols, np.ascontiguousarray(self.data[order]))

    @staticmethod
    def stack(parts: list[RawBlocks]) -> RawBlocks:
        """Matrices of one format and width, one under another (fused q/k/v, gate/up)."""
        first = parts[0]
        if any(p.format != first.format or p.cols != first.cols for p in parts):
            raise ValueError("only matrices of one block format and width can be stacked")
        data = np.concatenate([p.data for p in parts], axis=0)
        return RawBlocks(first.format, sum(p.rows for p in parts), first.cols, data)
