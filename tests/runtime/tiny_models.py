"""Tiny random-weight Hugging Face model folders of each supported architecture, for tests.

Every parameter is randomised (biases and norm weights included: transformers initialises
those to constants, which would hide bugs in how they are applied).
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

KINDS = ("llama", "llama3_rope", "mistral", "mistral_window", "qwen2", "qwen2_window", "qwen3")
# The sliding windows of the windowed kinds: short, so that tests' sequences outgrow them.
WINDOWS = {"mistral_window": 8, "qwen2_window": 6}


def tiny_config(kind: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = COMMON | overrides

    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    if kind == "llama3_rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,  # puts one frequency in the blended band
        }
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
    if kind in ("mistral", "mistral_window"):
        window = WINDOWS.get(kind)
        return MistralConfig(**({"sliding_window": window, "head_dim": 16} | common))
    if kind == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen2_window":
        # The window on the upper layer only (from max_window_layers up), as Qwen2 places it.
        window = {"use_sliding_window": True, "sliding_window": WINDOWS[kind]}
        return Qwen2Config(**(window | common), max_window_layers=1, tie_word_embeddings=True)
    if kind == "qwen3":
        # head_dim apart from hidden / heads, as in the real Qwen3 models.
        return Qwen3Config(**common, head_dim=24, tie_word_embeddings=False)
    raise ValueError(kind)


def make_tiny_model(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Write a random ``kind`` model (config.json + model.safetensors) into ``folder``.

    ``overrides`` replace config fields (e.g. ``max_position_embeddings``)."""
    random_model(tiny_config(kind, **overrides), seed).save_pretrained(folder)
    return folder


def random_model(config, seed: int = 0):
    """A float32 transformers model of ``config``, every parameter random, norms around 1."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.15 * torch.randn_like(param))
    return model


def load_reference(folder: Path, attn: str = "eager"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attn, local_files_only=True
    )
    return model.eval()


# The drafter's step cost, pinned (ms: fixed, per sequence, per token; the CPU prior): learnt
# from perf_counter times, it would make how many tokens are drafted depend on the machine's
# load, and so every count of drafts, verify steps and steps that a test asserts.
PINNED_STEP_COST_MS = (19.0, 1.0, 0.4)


def stepped_engine(folder: Path, **kw):
    """An engine the test drives step by step, checking every invariant after each step, in
    float32 (compared with float32 transformers; "auto" may pick bfloat16). Defaults: 256
    blocks of 4 tokens."""
    from radixlang.runtime.engine import Engine

    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("background", False)
    kw.setdefault("check_integrity_every_step", True)
    kw.setdefault("dtype", "float32")
    if kw.get("speculative", "off") != "off":
        kw.setdefault("speculative_step_cost_ms", PINNED_STEP_COST_MS)
    return Engine(folder, **kw)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of one prompt, EOS ignored."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def make_tiny_llama_with_tokenizer(folder: Path, **overrides) -> Path:
    """A tiny random llama with the default model's tokenizer and chat template (49,152
    tokens), so that stop strings, regexes and chat prompts work on it."""
    import shutil

    from radixlang.model_files import DEFAULT_MODEL, load_model_files

    path = make_tiny_model("llama", folder, vocab_size=49152, **overrides)
    source = load_model_files(DEFAULT_MODEL).path
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path
