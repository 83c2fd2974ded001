"""Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter.

``TRITON_INTERPRET`` must be set before a Triton kernel is defined, i.e. before the first
import of a ``radixlang.kernels`` Triton module. pytest imports this file before any test
module, so it holds even when another test module imports triton first. With
a GPU it is left unset, so the GPU tests run the compiled kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
