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
