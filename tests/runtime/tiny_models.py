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

KINDS = (
    "llama",
    "llama3_rope",
    "mistral",
    "mistral_window",
    "qwen2",
    "qwen2_window",
    "qwen3",
    "phi3",
    "phi3_longrope",
    "gemma3",
    "qwen3_moe",
    "mixtral",
)
# The sliding windows of the windowed kinds: short, so that tests' sequences outgrow them.
WINDOWS = {"mistral_window": 8, "qwen2_window": 6, "phi3": 10, "gemma3": 6, "mixtral": 7}
# phi3_longrope's pretraining length: every test sequence but one-token ones is longer, so that
# transformers runs it on the long factors, as the runner always does (see models/rope.py).
LONGROPE_ORIGINAL = 8


def tiny_config(kind: str, **overrides):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

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
    # Phi-3's default token ids lie past the tiny vocabulary.
    phi_ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if kind == "phi3":
        # Fused qkv_proj and gate_up_proj; a window on every layer, as Phi-3-mini-4k has.
        return Phi3Config(**(phi_ids | common), sliding_window=WINDOWS[kind])
    if kind == "phi3_longrope":
        # Phi-4-mini's shape: LongRoPE over the first 3/4 of each head (12 of 16 dims, 6
        # frequencies), untied output.
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
        }
        return Phi3Config(
            **(phi_ids | common),
            rope_parameters=rope,
            original_max_position_embeddings=LONGROPE_ORIGINAL,
        )
    if kind == "gemma3":
        # Local (windowed) and global layers with their own rotary bases, the global one
        # linearly scaled; query_pre_attn_scalar apart from head_dim; a final logit cap.
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        }
        gemma = {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOWS[kind],
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "rope_parameters": rope,
            "final_logit_softcapping": 10.0,
        }
        return Gemma3TextConfig(**(COMMON | gemma | overrides))
    if kind == "qwen3_moe":
        # Three layers, the first dense (mlp_only_layers) and 96 wide, the others 4 experts of
        # 48, two per token, renormalised; head_dim apart from hidden / heads, as in Qwen3-30B-A3B.
        moe = {
            "num_hidden_layers": 3,
            "head_dim": 24,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        }
        return Qwen3MoeConfig(**(COMMON | moe | overrides), tie_word_embeddings=False)
    if kind == "mixtral":
        # Every layer sparse: 4 experts of intermediate_size, two per token; a window on every
        # layer.
        moe = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOWS[kind]}
        return MixtralConfig(**(COMMON | moe | overrides))
    raise ValueError(kind)


def make_tiny_model(kind: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Write a random ``kind`` model (config.json + model.safetensors) into ``folder``.

    ``overrides`` replace config fields (e.g. ``max_position_embeddings``)."""
    random_model(tiny_config(kind, **overrides), seed).save_pretrained(folder)
    return folder


def make_tiny_gemma3_multimodal(folder: Path, seed: int = 0) -> Path:
    """A random ``Gemma3ForConditionalGeneration`` (the gemma3 kind's text model beside a
    one-layer SigLIP tower) saved as transformers saves it: the language model's weights under
    ``language_model.``."""
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    # No final logit cap, as in Gemma 3's configs: transformers' multimodal model never
    # applies one (its text-only model does).
    config = Gemma3Config(
        text_config=tiny_config("gemma3", final_logit_softcapping=None).to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=157,
        eoi_token_index=158,
        image_token_index=159,
    )
    random_model(config, seed).save_pretrained(folder)
    return folder


def random_model(config, seed: int = 0):
    """A float32 transformers model of ``config``, every parameter random, norms around 1 (as
    applied: Gemma's norms scale by ``1 + w``, so their weights lie around 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    norm_center = 0.0 if config.model_type.startswith("gemma") else 1.0
    # (A multimodal Gemma's vision tower has LayerNorms, drawn around 0 too: not under test.)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(norm_center + 0.2 * torch.randn_like(param))
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


# Chat templates in the shape of the families' own (their turn markers, spelt in the default
# model's vocabulary): Phi-3's <|role|> ... <|end|>; Gemma 3's <start_of_turn>, with the
# "model" role and no system role (a system message is folded into the first user turn); the
# mixture-of-experts kinds' below.
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = m.content + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m.content | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Qwen3's ChatML turns with its Hermes calls, a <tool_call> block per call; Mixtral's
# [INST] ... [/INST] with no system role (folded into the first user turn) and no generation
# prompt, each reply closed by EOS.
QWEN3_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant"
    # (A newline right after a block tag would be trimmed: transformers renders with
    # trim_blocks.)
    "{% if m.content %}{{ '\\n' }}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}"
    '{{ "\\n" }}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MIXTRAL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = m.content + '\n\n' %}"
    "{% elif m.role == 'user' %}[INST] {{ ns.system }}{% set ns.system = '' %}"
    "{{ m.content }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
CHAT_TEMPLATES = {
    "phi3": PHI3_TEMPLATE,
    "phi3_longrope": PHI3_TEMPLATE,
    "gemma3": GEMMA3_TEMPLATE,
    "qwen3_moe": QWEN3_TEMPLATE,
    "mixtral": MIXTRAL_TEMPLATE,
}


def make_tiny_model_with_tokenizer(kind: str, folder: Path, **overrides) -> Path:
    """A tiny random ``kind`` model with the default model's tokenizer (49,152 tokens), so that
    stop strings, regexes and chat prompts work on it; its chat template is the default
    model's, or the family's shape from ``CHAT_TEMPLATES``."""
    import shutil

    from radixlang.model_files import DEFAULT_MODEL, load_model_files

    path = make_tiny_model(kind, folder, vocab_size=49152, **overrides)
    source = load_model_files(DEFAULT_MODEL).path
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    if kind in CHAT_TEMPLATES:
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATES[kind])
    return path


def make_tiny_llama_with_tokenizer(folder: Path, **overrides) -> Path:
    """A tiny random llama with the default model's tokenizer and chat template (49,152
    tokens), so that stop strings, regexes and chat prompts work on it."""
    return make_tiny_model_with_tokenizer("llama", folder, **overrides)


def cpu_has(flag: str) -> bool:
    """Whether this CPU reports ``flag`` (``/proc/cpuinfo``; False where there is none)."""
    try:
        return flag in open("/proc/cpuinfo").read().split()
    except OSError:
        return False
