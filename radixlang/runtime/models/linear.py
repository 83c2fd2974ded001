"""Linear layers with weights prepacked for oneDNN on CPUs.

On this project's CPUs, torch's default ``F.linear`` goes through a BLAS path that runs float32
matmuls 2-3x slower than oneDNN with a weight reordered once at load time (the layout torch's
own compiler uses for frozen CPU models). ``Linear`` uses that path when torch has it, checks it
once against ``F.linear``, and otherwise (GPUs, builds without oneDNN, ``RADIXLANG_ONEDNN=0``)
calls ``F.linear``.

oneDNN's bfloat16 path is slow at a few rows on CPUs with AVX-512 BF16 but no AMX (it streamed
about 19 GB/s where the machine reads 30-50): there a small model's bfloat16 linears also keep
the batch-invariant kernel's packing and take it for batches of up to ``SMALL_BATCH_ROWS`` rows
(``small_batch_kernel``).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from radixlang import kernels
from radixlang.kernels import invariant_linear, native_linear
from radixlang.runtime.dtype_choice import CPUINFO, cpu_flags

PACKING_BATCH_HINT = 32
# Rows up to which a small model's bfloat16 linear takes the invariant kernel (see the top).
# Measured on a 2-core Zen 4 (avx512_bf16, no AMX), a step's linears, oneDNN against the
# invariant kernel: SmolLM2-135M's 11.4 / 8.3 ms at 1 row, 11.9 / 8.4 at 8, 23.0 / 21.8 at 32,
# 71.5 / 73.8 at 128; SmolLM2-1.7B's 123 / 101 at 1, 124 / 107 at 8, 270 / 334 at 32.
SMALL_BATCH_ROWS = 16
# Models whose float linears hold at most this many bytes keep the second packing: it doubles
# their weights' memory, which matters for a 1.7B model's 3.4 GB and not for a 135M model's 0.27.
SMALL_BATCH_MODEL_BYTES = 1 << 30
SMALL_BATCH_ENV = "RADIXLANG_SMALL_BATCH_KERNEL"  # "0": never


@functools.cache
def onednn_linear_available(dtype: torch.dtype) -> bool:
    """Whether prepacked oneDNN linears work here for ``dtype`` (probed once per dtype)."""
    if os.environ.get("RADIXLANG_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.linspace(-1, 1, 48 * 40).view(48, 40).to(dtype)
        x = torch.linspace(-1, 1, 3 * 40).view(3, 40).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(got.float(), F.linear(x, weight).float(), atol=1e-2))


def small_batch_kernel(dtype: torch.dtype, model_bytes: int, cpuinfo: str | None = None) -> bool:
    """Whether a model whose float linears hold ``model_bytes`` of ``dtype`` weights on the CPU
    keeps the invariant kernel's packing for small batches (see the top): bfloat16, a CPU with
    AVX-512 BF16 and no AMX, the kernel built, and a model small enough."""
    if os.environ.get(SMALL_BATCH_ENV, "1") == "0" or dtype != torch.bfloat16:
        return False
    if model_bytes > SMALL_BATCH_MODEL_BYTES:
        return False
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            return False
    flags = cpu_flags(cpuinfo)
    return "avx512_bf16" in flags and "amx_bf16" not in flags and invariant_linear.available()


class Linear:
    """``y = x @ weight.T + bias`` for ``weight`` ``[out, in]``; ``small_batch``: batches of up
    to ``SMALL_BATCH_ROWS`` rows take the invariant kernel (a second packing of the weight)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, small_batch: bool = False
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.num_bytes = weight.numel() * weight.element_size()
        self.small: invariant_linear.PackedWeight | None = None
        if small_batch and weight.device.type == "cpu":
            self.small = invariant_linear.pack(weight, bias)
            self.num_bytes += self.small.packed.numel() * self.small.packed.element_size()
        self.onednn = weight.device.type == "cpu" and onednn_linear_available(weight.dtype)
        # The packed copy replaces the plain weight, so memory is not doubled. The batch-size
        # hint picks the packed layout: 1 measured up to 1.8x slower in float32 than 8 or more,
        # at every batch size.
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)
            if self.onednn
            else weight
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
            return invariant_linear.linear(x, self.small)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class InvariantLinear:
    """``y = x @ weight.T + bias`` with every row's result independent of the other rows, their
    number and the thread count (deterministic inference): the native CPU kernel of
    ``kernels/invariant_linear.py``, Triton's fixed-tile matmul where the kernels are Triton's
    (GPUs), or on a CPU where the native kernel does not build, ``F.linear`` one row at a
    time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.num_bytes = weight.numel() * weight.element_size()
        self.weight: torch.Tensor | None = None
        self.bias = bias
        self.packed: invariant_linear.PackedWeight | None = None
        if kernels.use_triton(weight):  # a GPU (or RADIXLANG_KERNELS=triton)
            self.kind = "triton"
            self.weight = weight.contiguous()
        elif invariant_linear.available():
            self.kind = "native"
            self.packed = invariant_linear.pack(weight, bias)
        else:
            self.kind = "rowwise"
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return invariant_linear.linear(x, self.packed)
        assert self.weight is not None
        if self.kind == "triton":
            from radixlang.kernels import triton_matmul

            return triton_matmul.matmul(x, self.weight, self.bias)
        return invariant_linear.rowwise_linear(x, self.weight, self.bias)


# auto: a .gguf file's blocks as stored (gguf), other models as "none". gguf: a GGUF model's
# Q4_0, Q4_1, Q8_0, Q4_K and Q6_K matrices multiplied from the file's blocks
# (models/block_linear.py); q8_0, q4_0: the layers' weights quantized at load into blocks.
QUANTIZATIONS = ("auto", "none", "int8", "gguf", "q8_0", "q4_0")


class Int8Linear:
    """``y = x @ weight.T + bias`` with int8 weights, one scale per output row (weight-only:
    activations stay in float). On CPUs with the native kernel (kernels/native_linear.py) the
    weights are packed for it; elsewhere torch's ``_weight_int8pack_mm`` computes the same.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        q, self.scales = native_linear.quantize_rows(weight)
        if native_linear.available():
            self.packed: native_linear.PackedInt8 | None = native_linear.pack(q, self.scales, bias)
            self.q = None
        else:
            self.packed, self.q = None, q
        self.num_bytes = q.numel() + self.scales.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y = native_linear.linear(x, self.packed)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.float(), self.q, self.scales)
            if self.bias is not None:
                y = y + self.bias.float()
        return y if x.dtype == torch.float32 else y.to(x.dtype)


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantization: str = "none",
    deterministic: bool = False,
    small_batch: bool = False,
) -> Linear | Int8Linear | InvariantLinear:
    """A linear layer holding ``weight`` as ``quantization`` says (``"none"``: as given);
    ``deterministic``: one whose rows do not depend on the batch (the int8 kernel's rows do
    not: each is summed in k order by the same tile code at every batch size); ``small_batch``:
    a float ``Linear`` also takes the invariant kernel for small batches."""
    if quantization == "none":
        if deterministic:
            return InvariantLinear(weight, bias)
        return Linear(weight, bias, small_batch)
    if quantization == "int8":
        if weight.device.type != "cpu":
            raise ValueError("int8 quantization runs on CPUs only")
        if deterministic and not native_linear.available():
            raise ValueError(
                "deterministic int8 inference needs the native int8 kernel, which did not build"
            )
        return Int8Linear(weight, bias)
    choices = ", ".join(QUANTIZATIONS)
    raise ValueError(f"quantization must be one of {choices}; got {quantization!r}")
