"""Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter.

``TRITON_INTERPRET`` must be set before a Triton kernel is defined, i.e. before the first
import of a ``radixlang.kernels`` Triton module. pytest imports this file before any test
module, so it holds even when another test module imports triton first. With
a GPU it is left unset, so the GPU tests run the compiled kernels.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# A tiny random-weight llama that speaks the default model's tokenizer and chat template, so
# frontend and server tests exercise real tokenization and the engine in milliseconds per call.
@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    from radixlang.testing import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-model"))
