"""Model folders for tests and smoke runs: random weights, the default model's tokenizer.

A tiny random-weight llama that speaks the default model's tokenizer and chat template makes
frontend, server and benchmark smoke tests exercise real tokenization (byte-level BPE, chat
templates, 49,152 tokens) while the engine runs in milliseconds per step. Nothing is fetched:
the tokenizer files come from the installed default model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from radixlang.models import DEFAULT_MODEL, load_model_files

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")  # fmt: skip


def write_tiny_chat_model(
    folder: str | Path,
    *,
    layers: int = 2,
    hidden_size: int = 64,
    max_positions: int = 1024,
    weight_std: float = 0.5,
    seed: int = 0,
) -> Path:
    """Write a random llama (``layers`` x ``hidden_size``, 4 query and 2 KV heads) with the
    default model's vocabulary, tokenizer and chat template into ``folder``. Weights are drawn
    from N(0, ``weight_std``): wide enough that sampling wanders over the whole vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = Path(folder)
    default = load_model_files(DEFAULT_MODEL)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=default.config.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, weight_std)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (default.path / name).exists():
            shutil.copy(default.path / name, folder / name)
    return folder
