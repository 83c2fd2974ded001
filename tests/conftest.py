"""Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter.

``TRITON_INTERPRET`` must be set before a Triton kernel is defined, i.e. before the first
import of a ``radixlang.kernels`` Triton module. pytest imports this file before any test
module, so it holds even when another test module imports triton first. With
a GPU it is left unset, so the GPU tests run the compiled kernels.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# A tiny random-weight llama that speaks the default model's tokenizer and chat template, so
# frontend and server tests exercise real tokenization and the engine in milliseconds per call.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")  # fmt: skip


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from radixlang.models import load_model_files

    default = load_model_files("smollm2-135m-instruct")
    folder = tmp_path_factory.mktemp("tiny-chat-model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=default.config.vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (default.path / name).exists():
            shutil.copy(default.path / name, folder / name)
    return folder
