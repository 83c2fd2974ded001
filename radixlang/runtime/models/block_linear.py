"""Linear layers whose weights stay in GGUF's quantized blocks (kernels/block_linear.py).

A layer may be several matrices stacked by rows (q/k/v fused, gate/up fused) whose formats
differ, as in llama.cpp's mixes (Q4_K_M keeps some projections at higher precision): each part
writes its own columns of the output. Parts in a format the packed kernel takes are repacked at
load (``block_linear.pack``: eight rows interleaved, the same bytes); the others are read in the
file's layout. A part the block kernels do not take is held as a float linear of the model's
dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from radixlang.kernels import block_linear
from radixlang.kernels.block_formats import RawBlocks
from radixlang.kernels.block_linear import AnyBlocks
from radixlang.runtime.dtype_choice import CPUINFO, cpu_flags
from radixlang.runtime.models.linear import InvariantLinear, Linear, make_linear

FloatLinear = Linear | InvariantLinear


class BlockLinear:
    """``y = x @ W.T + bias`` for ``W`` stacked from ``parts`` (``RawBlocks`` the kernel takes,
    or float weights ``[rows, in]``).

    Every batch multiplies from the blocks (activations quantized per 32-element block), except
    bfloat16 batches of ``block_linear.GEMM_MIN_ROWS`` rows or more on a CPU with AMX tiles
    (``amx_tiles``), outside deterministic mode: those dequantize each part and take torch's
    GEMM. The block kernels' rows do not depend on the batch."""

    def __init__(
        self,
        parts: list[RawBlocks | torch.Tensor],
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        deterministic: bool = False,
    ) -> None:
        widths = {p.cols if isinstance(p, RawBlocks) else p.shape[1] for p in parts}
        if len(widths) != 1:
            raise ValueError(f"stacked parts must share their input width; got {sorted(widths)}")
        self.in_features = widths.pop()
        self.deterministic = deterministic
        self.bias = bias
        self.parts: list[tuple[int, int, AnyBlocks | FloatLinear]] = []
        start = 0
        for part in parts:
            rows = part.rows if isinstance(part, RawBlocks) else part.shape[0]
            held: AnyBlocks | FloatLinear
            if isinstance(part, RawBlocks):
                held = block_linear.pack(part) if block_linear.packs(part) else part
            else:
                held = make_linear(part.to(dtype), None, "none", deterministic)  # type: ignore[assignment]
            self.parts.append((start, start + rows, held))
            start += rows
        self.out_features = start
        self.num_bytes = sum(p.num_bytes for _, _, p in self.parts) + (
            0 if bias is None else bias.numel() * bias.element_size()
        )

    @property
    def formats(self) -> list[str]:
        """Each part's storage type ("Q4_0", ...; "float" for a part held as a float linear)."""
        return [p.format.name if _is_blocks(p) else "float" for _, _, p in self.parts]

    @property
    def packed(self) -> list[bool]:
        """Whether each part was repacked for the packed kernel."""
        return [isinstance(p, block_linear.PackedBlocks) for _, _, p in self.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if (
            x2.shape[0] >= block_linear.GEMM_MIN_ROWS
            and x2.dtype == torch.bfloat16
            and not self.deterministic
            and amx_tiles()
        ):
            y = self._dequantized_gemm(x2)
        else:
            y = self._block_dots(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def _block_dots(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and all(
            isinstance(p, block_linear.PackedBlocks) for _, _, p in self.parts
        ):  # the kernel converts both ways itself
            xb = x.contiguous()
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
            for start, end, part in self.parts:
                block_linear.linear_into(xb, part, out[:, start:end])
            return out
        x32 = x.float().contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        for start, end, part in self.parts:
            if _is_blocks(part):
                block_linear.linear_into(x32, part, out[:, start:end])
            else:
                out[:, start:end] = part(x)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1 and _is_blocks(self.parts[0][2]):
            return F.linear(x, block_linear.dequantize(self.parts[0][2], x.dtype))
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        for start, end, part in self.parts:
            if _is_blocks(part):
                out[:, start:end] = F.linear(x, block_linear.dequantize(part, x.dtype))
            else:
                out[:, start:end] = part(x)
        return out


@functools.cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later), where torch's bfloat16 GEMM
    runs on them and outruns the packed kernel's integer dots at prefill (llama.cpp and SGLang
    use AMX for prefill there too). Without AMX, the packed kernel wins at every batch size:
    measured on a Zen 4 (AVX-512 VNNI, avx512_bf16), one thread, a [512, 2048] x [2048, 8192]
    product: 271 GOP/s for Q4_0 against 211 GFLOP/s for torch's bfloat16 GEMM alone."""
    try:
        return "amx_bf16" in cpu_flags(CPUINFO.read_text(errors="replace"))
    except OSError:
        return False


def _is_blocks(part: object) -> bool:
    return isinstance(part, RawBlocks | block_linear.PackedBlocks)


class BlockEmbedding:
    """Token embeddings kept as GGUF blocks: a lookup dequantizes only the rows it needs (a
    large vocabulary's table stays at its size in the file instead of the model's dtype)."""

    def __init__(self, blocks: RawBlocks, dtype: torch.dtype) -> None:
        self.blocks = blocks
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.shape = (blocks.rows, blocks.cols)
        self.num_bytes = blocks.num_bytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.take_rows(ids.reshape(-1).cpu().numpy())
        return block_linear.dequantize(rows, self.dtype).view(*ids.shape, self.blocks.cols)
