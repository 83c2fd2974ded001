"""Linear layers with weights prepacked for oneDNN on CPUs.

On this project's CPUs, torch's default ``F.linear`` goes through a BLAS path that runs float32
matmuls 2-3x slower than oneDNN with a weight reordered once at load time (the layout torch's
own compiler uses for frozen CPU models). ``Linear`` uses that path when torch has it, checks it
once against ``F.linear``, and otherwise (GPUs, builds without oneDNN, ``RADIXLANG_ONEDNN=0``)
calls ``F.linear``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from radixlang import kernels
from radixlang.kernels import invariant_linear, native_linear

PACKING_BATCH_HINT = 32


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


class Linear:
    """``y = x @ weight.T + bias`` for ``weight`` ``[out, in]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.num_bytes = weight.numel() * weight.element_size()
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
) -> Linear | Int8Linear | InvariantLinear:
    """A linear layer holding ``weight`` as ``quantization`` says (``"none"``: as given);
    ``deterministic``: one whose rows do not depend on the batch (the int8 kernel's rows do
    not: each is summed in k order by the same tile code at every batch size)."""
    if quantization == "none":
        return InvariantLinear(weight, bias) if deterministic else Linear(weight, bias)
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
