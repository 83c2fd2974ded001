"""What sets Phi-3, Gemma 3 and the mixture-of-experts families apart from the Llama baseline,
read from their transformers configs into ``LlamaArch``'s fields (the forward pass is one for
all of them).

- Phi-3 (``phi3``): q/k/v and gate/up stored fused (the loader takes either layout), LongRoPE
  (``rope.py``), partial rotary (Phi-4-mini rotates 3/4 of each head), a sliding window on
  every layer where the config sets one.
- Gemma 3 (``gemma3_text``): embeddings times sqrt(hidden_size), RMSNorm weights applied as
  ``1 + w`` (q/k norms too), a norm after attention and after the MLP besides the ones
  before (four per layer), GELU (tanh) gating, queries scaled by ``query_pre_attn_scalar ** -0.5``,
  sliding-window and global layers (``layer_types``) with their own rotary bases, and an
  optional final logit soft-cap.
- Qwen3-MoE (``qwen3_moe``): Qwen3's attention (q/k norms); the MLP of the layers that
  ``decoder_sparse_step`` and ``mlp_only_layers`` pick is sparse (``moe.py``): a softmax router
  over ``num_experts``, the top ``num_experts_per_tok`` kept (renormalised to sum 1 under
  ``norm_topk_prob``), each expert ``moe_intermediate_size`` wide; the other layers are dense.
- Mixtral (``mixtral``): Mistral's attention (a window on every layer where the config sets
  one); every layer's MLP sparse, ``num_local_experts`` experts ``intermediate_size`` wide, the
  top-k routing weights always renormalised (a softmax over the chosen logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from radixlang.model_files import UnsupportedModelError


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The MLP gate's activation, by transformers' name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
}
# Those whose transformers implementation rotates only part of each head when told to.
PARTIAL_ROTARY_TYPES = ("phi3",)
# Those with per-head RMSNorms over q and k before the rotation.
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3_text")
# Those with sparse mixture-of-experts MLPs (``moe_fields``).
MOE_TYPES = ("qwen3_moe", "mixtral")


def rope_fields(config: Any, model_type: str, head_dim: int) -> dict[str, Any]:
    """``rope_parameters`` (of every layer, or of the global ones where the sliding layers have
    their own: ``local_rope_parameters``) and ``rotary_dim``."""
    raw = dict(getattr(config, "rope_parameters", None) or {})
    local = None
    if model_type == "gemma3_text":
        # Nested by layer type: the sliding layers' base is the config's rope_local_base_freq.
        local = dict(raw.get("sliding_attention") or {"rope_theta": 10000.0})
        raw = dict(raw.get("full_attention") or {})
    raw.setdefault("rope_theta", float(getattr(config, "rope_theta", None) or 10000.0))
    factor = raw.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    factor = float(factor or 1.0)
    if factor != 1.0 and model_type not in PARTIAL_ROTARY_TYPES:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(f"a rotary dimension of {rotary_dim} is not supported")
    return {"rope_parameters": raw, "local_rope_parameters": local, "rotary_dim": rotary_dim}


def family_fields(config: Any, model_type: str, head_dim: int) -> dict[str, Any]:
    """The ``LlamaArch`` fields that differ by family (activation, norms, scales, caps)."""
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    activation = activation or "silu"
    if activation not in ACTIVATIONS:
        raise UnsupportedModelError(f"activation {activation!r} is not supported")
    fields: dict[str, Any] = {
        "activation": activation,
        "qk_norm": model_type in QK_NORM_TYPES,
        "attn_scale": head_dim**-0.5,
    }
    if model_type != "gemma3_text":
        return fields
    # No attention kernel (torch, native, Triton) caps logits: refused rather than computed
    # without the cap. (Gemma 3 sets none; Gemma 2 did.)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError("attention logit soft-capping is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported")
    hidden = int(config.hidden_size)
    cap = getattr(config, "final_logit_softcapping", None)
    return fields | {
        "attn_scale": float(config.query_pre_attn_scalar) ** -0.5,
        "embed_scale": hidden**0.5,
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "final_logit_softcap": None if cap is None else float(cap),
    }


def moe_fields(config: Any, model_type: str) -> dict[str, Any]:
    """The ``LlamaArch`` fields of a mixture-of-experts model: which layers are sparse, the
    experts' count and width, how many a token takes and whether their weights are renormalised
    (none for a dense model)."""
    if model_type not in MOE_TYPES:
        return {}
    layers = int(config.num_hidden_layers)
    # transformers maps num_experts to num_local_experts on both configs; a raw object may
    # carry either name.
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    experts, top_k = int(experts or 0), int(config.num_experts_per_tok)
    if model_type == "mixtral":
        sparse = tuple(range(layers))
        width = int(config.intermediate_size)
        normalize = True
    else:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in getattr(config, "mlp_only_layers", None) or ()}
        sparse = tuple(
            i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0
        )
        width = int(config.moe_intermediate_size)
        normalize = bool(getattr(config, "norm_topk_prob", False))
    if sparse and not 0 < top_k <= experts:
        raise UnsupportedModelError(f"{top_k} experts per token of {experts} is not supported")
    return {
        "moe_layers": sparse,
        "num_experts": experts if sparse else 0,
        "experts_per_token": top_k if sparse else 0,
        "expert_intermediate_size": width if sparse else 0,
        "norm_topk_prob": normalize,
    }


# Multimodal wrappers whose language model runs here (its text only: no image inputs).
MULTIMODAL_TYPES = ("gemma3",)


def text_config(config: Any) -> Any:
    """A multimodal wrapper's language-model config (Gemma 3's ``text_config``), else
    ``config``."""
    if getattr(config, "model_type", None) in MULTIMODAL_TYPES:
        return config.text_config
    return config


class LanguageModelWeights:
    """A multimodal checkpoint's language-model tensors under the text model's names.

    ``Gemma3ForConditionalGeneration`` saves ``model.*`` and ``lm_head.weight`` of its language
    model as ``language_model.model.*`` and ``language_model.lm_head.weight`` (transformers 4's
    layout, which 5 keeps on disk), or, in 5's module layout, ``model.language_model.*``; the
    vision tower and projector are never read.
    """

    def __init__(self, weights: Any) -> None:
        self._weights = weights

    def _name(self, name: str) -> str:
        inner = name.removeprefix("model.")
        for candidate in (
            "language_model." + name,
            "model.language_model." + inner,
            name,
        ):
            if self._weights.has(candidate):
                return candidate
        return name

    def has(self, name: str) -> bool:
        return self._weights.has(self._name(name))

    def get(self, name: str) -> Any:
        return self._weights.get(self._name(name))
