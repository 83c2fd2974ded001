"""A tiny random-weight llama that speaks the default model's tokenizer and chat template, so
frontend tests exercise real tokenization and the engine in well under a second per call."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="session")
def tiny_runtime(chat_model_dir):
    import radixlang as sgl

    rt = sgl.Runtime(model_path=str(chat_model_dir), kv_memory="64MiB")
    yield rt
    rt.shutdown()
