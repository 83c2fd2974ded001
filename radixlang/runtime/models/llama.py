"""The Llama family over the paged KV cache: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 3 (text), and the mixture-of-experts Qwen3-MoE and Mixtral.

One implementation covers them: RMSNorm, rotary embeddings (default, linear, llama3, longrope;
partial rotary), grouped-query attention, SwiGLU, optional q/k/v biases (Qwen2) and per-head q/k
norms (Qwen3), tied or separate output embeddings, sliding-window attention (Mistral; Qwen2/3
with ``use_sliding_window`` on their upper layers; Phi-3), and the fields Gemma 3 adds (see
``families.py``), and sparse expert MLPs on the layers a mixture-of-experts config names
(``moe.py``). Weights are plain tensors (q/k/v and gate/up fused into one matmul each,
whether the checkpoint stores them apart or fused, as Phi-3 does) read from a Hugging Face
safetensors folder or a GGUF file (its quantized matrices kept as the file's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from radixlang import kernels
from radixlang.kernels import block_linear as block_kernel
from radixlang.kernels.rms_norm import add_rms_norm
from radixlang.model_files import UnsupportedModelError
from radixlang.runtime.forward_batch import ForwardBatch
from radixlang.runtime.kv_cache import KVCache, KVShape
from radixlang.runtime.models.block_linear import BlockEmbedding, BlockLinear
from radixlang.runtime.models.families import (
    ACTIVATIONS,
    MULTIMODAL_TYPES,
    LanguageModelWeights,
    family_fields,
    moe_fields,
    rope_fields,
    text_config,
)
from radixlang.runtime.models.linear import (
    Int8Linear,
    InvariantLinear,
    Linear,
    make_linear,
    small_batch_kernel,
)
from radixlang.runtime.models.moe import SparseMLP, load_sparse_mlp
from radixlang.runtime.models.rope import Rotary, apply_rotary

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "qwen3_moe", "mixtral",
)  # fmt: skip
# Those whose transformers implementation applies a config's sliding window.
WINDOWED_MODEL_TYPES = ("mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class LlamaArch:
    """The architecture facts the forward pass needs, read from the model's config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any] = field(hash=False)
    max_context: int
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before the rotation
    tie_word_embeddings: bool
    # Per layer: the sliding window (the token at position p sees p - W + 1 .. p), or None
    # for full attention. Empty means full attention everywhere.
    layer_windows: tuple[int | None, ...] = ()
    # The leading dims of each head that are rotated (0: all of them; Phi-4-mini: 3/4), and
    # the rope of the windowed layers where it is not ``rope_parameters`` (Gemma 3's local).
    rotary_dim: int = 0
    local_rope_parameters: dict[str, Any] | None = field(default=None, hash=False)
    activation: str = "silu"
    attn_scale: float = 0.0  # the queries' softmax scale; 0: head_dim ** -0.5
    # Gemma: embeddings times this (rounded to the model's dtype, as transformers does), norm
    # weights applied as ``norm_offset + w``, the attention's and the MLP's outputs normed
    # before the residual add (``sandwich_norms``), logits capped at +-``final_logit_softcap``.
    embed_scale: float | None = None
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    final_logit_softcap: float | None = None
    # Mixture of experts (``moe.py``): the layers whose MLP is sparse (the others are dense,
    # ``intermediate_size`` wide), each routing a token to ``experts_per_token`` of
    # ``num_experts`` experts ``expert_intermediate_size`` wide; ``norm_topk_prob``: the chosen
    # experts' router weights renormalised to sum to 1.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @property
    def linear_weights(self) -> int:
        """Weights in the model's linear layers (every expert and router included), the output
        layer included."""
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (2 * q_width + 2 * kv_width)
        dense = 3 * self.hidden_size * self.intermediate_size
        sparse = self.num_experts * self.hidden_size * (3 * self.expert_intermediate_size + 1)
        moe = len(self.moe_layers)
        per_model = self.num_layers * attention + (self.num_layers - moe) * dense + moe * sparse
        return per_model + self.vocab_size * self.hidden_size

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return layer in self.moe_layers

    @classmethod
    def from_config(cls, config: Any) -> LlamaArch:
        """From a transformers config object (or anything with the same attributes); of a
        multimodal wrapper (Gemma 3), its language model's."""
        config = text_config(config)
        model_type = getattr(config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            max_context=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            layer_windows=_layer_windows(config),
            **rope_fields(config, model_type, head_dim),
            **family_fields(config, model_type, head_dim),
            **moe_fields(config, model_type),
        )

    @property
    def kv_shape(self) -> KVShape:
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def sliding_window(self) -> int | None:
        """The window every layer attends within, or None when any layer sees everything:
        positions before it are never read again, so their KV blocks may be released."""
        windows = set(self.layer_windows)
        if not windows or None in windows:
            return None
        return max(windows)  # type: ignore[type-var]

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None


def _layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window, as transformers applies them.

    Mistral windows every layer (``sliding_window`` set, no ``layer_types``); Qwen2/3 set
    ``sliding_window`` only under ``use_sliding_window`` and window the layers ``layer_types``
    marks ``sliding_attention`` (from ``max_window_layers`` up).
    """
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return ()
    if getattr(config, "model_type", None) not in WINDOWED_MODEL_TYPES:
        return ()  # transformers' Llama ignores a sliding_window its config may carry
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        return (int(window),) * layers
    if len(types) != layers:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {layers} layers")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


AnyLinear = Linear | Int8Linear | InvariantLinear | BlockLinear
# Float models quantized at load into GGUF blocks, multiplied by the same kernel as GGUF files.
QUANTIZE_AT_LOAD = {"q8_0": "Q8_0", "q4_0": "Q4_0"}


def _quantized(weight: torch.Tensor, fmt: str, device: torch.device) -> Any:
    """``weight`` (float32) as ``fmt`` blocks for the block kernel; a matrix whose rows do not
    split into 32-element blocks stays float."""
    if device.type != "cpu":
        raise ValueError(f"{fmt} weights run on CPUs only")
    if not block_kernel.available():
        raise ValueError(f"{fmt} weights need the native block kernel, which did not build here")
    return block_kernel.quantize(weight, fmt) if weight.shape[1] % 32 == 0 else weight


def _kernel_blocks(
    weights: Any, names: list[str], device: torch.device, expert: int | None = None
) -> list[Any] | None:
    """Each name's ``RawBlocks`` (``expert``: that expert's matrix of each 3-D expert tensor)
    where the block kernel multiplies it (``None`` in its place for a matrix to hold as floats),
    or ``None`` when no part is for the kernel: not on a CPU, no native kernel here, or no part
    stored in a block format it takes."""
    if device.type != "cpu" or not block_kernel.available():
        return None
    blocks = [weights.blocks(n, expert) for n in names]
    blocks = [b if b is not None and block_kernel.takes(b) else None for b in blocks]
    return blocks if any(b is not None for b in blocks) else None


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: AnyLinear  # hidden -> (heads + 2 * kv_heads) * head_dim
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: AnyLinear
    post_norm: torch.Tensor  # before the MLP (Gemma's pre_feedforward_layernorm)
    # A dense MLP (gate_up: hidden -> 2 * intermediate, and down), or a sparse one (moe).
    gate_up: AnyLinear | None
    down: AnyLinear | None
    # Gemma's sandwich norms: over the attention's and the MLP's outputs before the residual.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    moe: SparseMLP | None = None


class LlamaForCausalLM:
    """Forward passes of a packed batch over the paged KV cache.

    ``deterministic`` (deterministic inference): a token's logits are bitwise the same whatever
    else is in its batch, however its prompt was chunked, and whether its prefix was computed
    now or came from the cache. Every op that reduces over a batch-dependent shape takes a
    batch-invariant form: the linears (``InvariantLinear``), attention (the kernels'
    ``deterministic`` mode), and the rotary angles, looked up per position in a table made once
    instead of computed over the batch's positions. Norms, activations and sums are row-wise.
    """

    def __init__(
        self,
        arch: LlamaArch,
        embed: torch.Tensor | BlockEmbedding,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: AnyLinear,
        deterministic: bool = False,
    ) -> None:
        self.arch = arch
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        self.scale = arch.attn_scale or arch.head_dim**-0.5
        self.deterministic = deterministic
        rotary_dim = arch.rotary_dim or arch.head_dim
        self.rotary = Rotary(
            rotary_dim, arch.rope_parameters, arch.max_context, self.dtype, self.device,
            deterministic,
        )  # fmt: skip
        local = arch.local_rope_parameters
        self.local_rotary = (
            None
            if local is None
            else Rotary(rotary_dim, local, arch.max_context, self.dtype, self.device, deterministic)
        )
        self.activation = ACTIVATIONS[arch.activation]
        # As transformers: the scale rounded to the embeddings' dtype, then the product.
        self.embed_scale = (
            None
            if arch.embed_scale is None
            else float(torch.tensor(arch.embed_scale).to(self.dtype).float())
        )

    @classmethod
    def from_folder(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        config: Any = None,
        quantization: str = "none",
        deterministic: bool = False,
    ) -> LlamaForCausalLM:
        """Load a Hugging Face folder (``config.json`` + ``*.safetensors``).

        ``quantization="int8"`` holds the layers' linear weights in int8 (``Int8Linear``); the
        embeddings, norms and the output layer keep ``dtype``. ``deterministic``: see the class.
        """
        path = Path(path)
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(path, local_files_only=True)
        return cls._from_weights(
            config, _SafetensorsFolder(path), dtype, device, quantization, deterministic
        )

    @classmethod
    def from_gguf(
        cls,
        path: str | Path,
        config: Any,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        deterministic: bool = False,
    ) -> LlamaForCausalLM:
        """Load a GGUF file's weights as they are stored: Q4_0, Q4_1, Q8_0, Q4_K and Q6_K
        matrices stay blocks of the memory-mapped file (``BlockLinear``), float ones take
        ``dtype``; other quantized types are dequantized to ``dtype``; Gemma's norm weights
        are taken as the file holds them, ``1 + w``; a mixture-of-experts layer's experts are
        each a slice of the file's 3-D expert tensors, kept the same way. ``config``: the
        transformers config the file's metadata gives."""
        from radixlang.runtime.models.gguf_weights import GGUFWeights

        return cls._from_weights(config, GGUFWeights(path), dtype, device, "gguf", deterministic)

    @classmethod
    def _from_weights(
        cls,
        config: Any,
        weights: Any,
        dtype: torch.dtype,
        device: str | torch.device,
        quantization: str,
        deterministic: bool,
    ) -> LlamaForCausalLM:
        arch = LlamaArch.from_config(config)
        if getattr(config, "model_type", None) in MULTIMODAL_TYPES:
            if quantization == "gguf":
                raise UnsupportedModelError("a multimodal GGUF file is not supported")
            weights = LanguageModelWeights(weights)
        device = torch.device(device)
        # Float linears of a small model keep the invariant kernel for small batches too.
        small_batch = (
            device.type == "cpu"
            and not deterministic
            and quantization in ("none", "gguf")
            and small_batch_kernel(dtype, arch.linear_weights * dtype.itemsize)
        )

        def load(name: str, expert: int | None = None) -> torch.Tensor:
            # ``expert``: one expert's matrix of a GGUF file's 3-D expert tensor.
            weight = weights.get(name) if expert is None else weights.get(name, expert=expert)
            return weight.to(device=device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return load(name) if weights.has(name) else None

        def norm(name: str) -> torch.Tensor:
            # Gemma's ``1 + w``, added in float32 once here rather than per forward.
            if not arch.norm_offset:
                return load(name)
            if getattr(weights, "norm_shift", 0.0) == arch.norm_offset:
                # A GGUF file holds ``1 + w`` already (llama.cpp's converter adds the 1).
                weight = weights.get(name, as_stored=True)
            else:
                weight = weights.get(name).float() + arch.norm_offset
            return weight.to(device=device, dtype=dtype).contiguous()

        def maybe_norm(name: str) -> torch.Tensor | None:
            return norm(name) if weights.has(name) else None

        def stacked(parts: list[torch.Tensor], bias: torch.Tensor | None = None) -> AnyLinear:
            """One linear of ``parts`` (checkpoint tensors) stacked by rows, held as
            ``quantization`` says (not ``gguf``: its blocks are read by name)."""
            if quantization in QUANTIZE_AT_LOAD:
                fmt = QUANTIZE_AT_LOAD[quantization]
                blocks = [_quantized(p, fmt, device) for p in parts]
                return BlockLinear(blocks, bias, dtype, deterministic)  # type: ignore[arg-type]
            held = [p.to(device=device, dtype=dtype) for p in parts]
            weight = (torch.cat(held) if len(held) > 1 else held[0]).contiguous()
            return make_linear(weight, bias, quantization, deterministic, small_batch)

        def router(weight: torch.Tensor) -> AnyLinear:
            # Kept float whatever the quantization: a rounded router logit may flip a token's
            # choice of expert, a far larger change than a rounded weight's.
            weight = weight.to(device=device, dtype=dtype).contiguous()
            return make_linear(weight, None, "none", deterministic, small_batch)

        def linear(
            names: list[str], bias: torch.Tensor | None = None, expert: int | None = None
        ) -> AnyLinear:
            """One linear of the named matrices stacked by rows; ``expert``: of that expert's
            matrix of each (GGUF's 3-D expert tensors, each expert's blocks kept apart)."""
            if quantization == "gguf":
                blocks = _kernel_blocks(weights, names, device, expert)
                if blocks is not None:
                    parts = zip(blocks, names, strict=True)
                    layer = BlockLinear(
                        [b if b is not None else load(n, expert) for b, n in parts],
                        bias,
                        dtype,
                        deterministic,
                    )
                    for name, packed in zip(names, layer.packed, strict=True):
                        if packed:
                            weights.release(name, expert)
                    return layer
                held = [load(n, expert) for n in names]
                weight = torch.cat(held) if len(held) > 1 else held[0]
                return make_linear(weight, bias, "none", deterministic, small_batch)
            if expert is not None:  # (only GGUF files hold experts so; read whole here)
                return stacked([weights.get(n)[expert] for n in names], bias)
            return stacked([weights.get(n) for n in names], bias)

        layers = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            # Phi-3 stores q/k/v and gate/up fused, in the order the forward pass splits them.
            if weights.has(attn + "qkv_proj.weight"):
                qkv = linear([attn + "qkv_proj.weight"], maybe(attn + "qkv_proj.bias"))
            else:
                biases = [maybe(attn + f"{n}_proj.bias") for n in "qkv"]
                if any(b is not None for b in biases) and any(b is None for b in biases):
                    raise UnsupportedModelError("q/k/v biases must be all present or all absent")
                qkv = linear(
                    [attn + f"{n}_proj.weight" for n in "qkv"],
                    None if biases[0] is None else torch.cat(biases),  # type: ignore[arg-type]
                )
            moe = gate_up = down = None
            if arch.is_sparse(i):
                moe = load_sparse_mlp(
                    weights, p, arch, stacked, router, lambda names, e: linear(names, expert=e)
                )
            elif weights.has(p + "mlp.gate_up_proj.weight"):
                gate_up = linear([p + "mlp.gate_up_proj.weight"])
            else:
                gate_up = linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            if moe is None:
                down = linear([p + "mlp.down_proj.weight"])
            # Gemma: post_attention_layernorm norms the attention's output; the MLP's input
            # norm is pre_feedforward_layernorm, and post_feedforward_layernorm its output's.
            sandwich = arch.sandwich_norms
            mlp_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
            layers.append(
                LayerWeights(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=qkv,
                    q_norm=maybe_norm(attn + "q_norm.weight") if arch.qk_norm else None,
                    k_norm=maybe_norm(attn + "k_norm.weight") if arch.qk_norm else None,
                    o=linear([attn + "o_proj.weight"], maybe(attn + "o_proj.bias")),
                    post_norm=norm(p + mlp_norm + ".weight"),
                    gate_up=gate_up,
                    down=down,
                    attn_out_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                    mlp_out_norm=norm(p + "post_feedforward_layernorm.weight")
                    if sandwich
                    else None,
                    moe=moe,
                )
            )
        embed_blocks = (
            _kernel_blocks(weights, ["model.embed_tokens.weight"], device)
            if quantization == "gguf"
            else None
        )
        embed: torch.Tensor | BlockEmbedding = (
            BlockEmbedding(embed_blocks[0], dtype)
            if embed_blocks is not None
            else load("model.embed_tokens.weight")
        )
        tied = arch.tie_word_embeddings or not weights.has("lm_head.weight")
        head = "model.embed_tokens.weight" if tied else "lm_head.weight"
        head_blocks = _kernel_blocks(weights, [head], device) if quantization == "gguf" else None
        if head_blocks is not None:
            lm_head: AnyLinear = BlockLinear(head_blocks, None, dtype, deterministic)  # type: ignore[arg-type]
            if lm_head.packed[0] and not (tied and isinstance(embed, BlockEmbedding)):
                weights.release(head)
        else:
            shared = tied and isinstance(embed, torch.Tensor)
            lm_head = make_linear(
                embed if shared else load(head),  # type: ignore[arg-type]
                deterministic=deterministic,
                small_batch=small_batch,
            )
        return cls(arch, embed, layers, norm("model.norm.weight"), lm_head, deterministic)

    @property
    def num_parameter_bytes(self) -> int:
        """Bytes of weights held (a tied output embedding counts again when packed apart)."""
        parts = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            parts += [t for t in vars(layer).values() if t is not None]
        return sum(
            p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.num_bytes
            for p in parts
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, logit_rows: torch.Tensor) -> torch.Tensor:
        """Run every layer over the batch, storing K/V; return float32 logits of ``logit_rows``."""
        arch = self.arch
        heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        tokens = batch.num_tokens
        n_ext, n_ext_seqs = batch.num_extend_tokens, batch.num_extend_seqs
        rope = self.rotary.cos_sin(batch.positions)
        local_rope = (
            rope if self.local_rotary is None else self.local_rotary.cos_sin(batch.positions)
        )
        deterministic = self.deterministic
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        eps = arch.rms_norm_eps

        # Once per forward and window: every layer of that window shares them.
        plans: dict[int | None, _AttentionPlans] = {}
        if isinstance(self.embed, torch.Tensor):
            residual = F.embedding(batch.input_ids, self.embed)
        else:
            residual = self.embed(batch.input_ids)
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        # Each branch's output is added to the residual stream by the norm that follows it (one
        # native call on CPUs, in place): the MLP's by the next layer's input norm. Deterministic
        # mode keeps torch's ops, bit for bit F.rms_norm as the reference models compute it: the
        # native sum of squares rounds otherwise in a few elements in 10^5, enough to move a
        # tiny model's greedy text, which deterministic users and tests pin.
        fused = not deterministic
        pending: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            normed = add_rms_norm(residual, pending, layer.input_norm, eps, fused)
            window = arch.window_of(i)
            cos, sin = rope if window is None else local_rope
            qkv = layer.qkv(normed)
            v = qkv[:, q_width + kv_width :].view(tokens, kv_heads, head_dim)
            if layer.q_norm is None:
                # q and k side by side: one rotation for both.
                qk = qkv[:, : q_width + kv_width].view(tokens, heads + kv_heads, head_dim)
                qk = apply_rotary(qk, cos, sin)
                q, k = qk[:, :heads], qk[:, heads:]
            else:
                q = _rms_norm(qkv[:, :q_width].view(tokens, heads, head_dim), layer.q_norm, eps)
                k = qkv[:, q_width : q_width + kv_width].view(tokens, kv_heads, head_dim)
                k = _rms_norm(k, layer.k_norm, eps)  # type: ignore[arg-type]
                q = apply_rotary(q, cos, sin)
                k = apply_rotary(k, cos, sin)
            cache = kv.layers[i]
            kernels.store_kv(k, v, batch.slot_mapping, cache)
            plan = plans.get(window)
            if plan is None:
                plan = plans[window] = _AttentionPlans.build(batch, cache, q, window, deterministic)
            attn = self._attention(batch, cache, q, k, v, n_ext, n_ext_seqs, plan)
            attn_out = layer.o(attn.view(tokens, q_width))
            if layer.attn_out_norm is not None:
                attn_out = _rms_norm(attn_out, layer.attn_out_norm, eps)
            normed = add_rms_norm(residual, attn_out, layer.post_norm, eps, fused)
            if layer.moe is not None:
                pending = layer.moe(normed, self.activation)
            else:
                gate, up = layer.gate_up(normed).chunk(2, dim=-1)  # type: ignore[misc]
                pending = layer.down(self.activation(gate) * up)  # type: ignore[misc]
            if layer.mlp_out_norm is not None:
                pending = _rms_norm(pending, layer.mlp_out_norm, eps)
        if pending is not None:
            residual.add_(pending)
        last = _rms_norm(residual.index_select(0, logit_rows), self.norm, eps)
        logits = self.lm_head(last).float()
        cap = arch.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _attention(
        self,
        batch: ForwardBatch,
        cache: kernels.PagedKV,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        n_ext: int,
        n_ext_seqs: int,
        plans: _AttentionPlans,
    ) -> torch.Tensor:
        s = n_ext_seqs
        host_lens = (batch.host_prefix_lens[:s], batch.host_extend_lens[:s])
        decode_plan, window, det = plans.decode, plans.window, plans.deterministic
        if n_ext_seqs == batch.num_seqs:
            return kernels.extend_attention(
                q,
                k,
                v,
                cache,
                batch.block_tables,
                batch.prefix_lens,
                batch.extend_lens,
                self.scale,
                host_lens,
                plans.extend,
                window=window,
            )
        if n_ext_seqs == 0:
            return kernels.decode_attention(
                q, cache, batch.block_tables, batch.seq_lens, self.scale, decode_plan, window, det
            )
        if plans.merged is not None:  # one native call for the extends and the decodes
            return kernels.planned_attention(q, cache, plans.merged, self.scale)
        out = torch.empty_like(q)
        out[:n_ext] = kernels.extend_attention(
            q[:n_ext],
            k[:n_ext],
            v[:n_ext],
            cache,
            batch.block_tables[:s],
            batch.prefix_lens[:s],
            batch.extend_lens[:s],
            self.scale,
            host_lens,
            plans.extend,
            window=window,
        )
        out[n_ext:] = kernels.decode_attention(
            q[n_ext:],
            cache,
            batch.block_tables[s:],
            batch.seq_lens[s:],
            self.scale,
            decode_plan,
            window,
            det,
        )
        return out


@dataclass(frozen=True)
class _AttentionPlans:
    """The kernels' per-batch plans for one sliding window (or none), made at the first layer
    of that window and shared by all its layers."""

    decode: kernels.AttentionPlan | None
    # Set where the native kernel runs the extends, and always when deterministic.
    extend: kernels.ExtendPlan | None
    window: int | None
    deterministic: bool
    # A mixed batch where both are the native kernel's: both in one plan, one call per layer.
    merged: kernels.NativePlan | None = None

    @classmethod
    def build(
        cls,
        batch: ForwardBatch,
        cache: kernels.PagedKV,
        q: torch.Tensor,
        window: int | None,
        deterministic: bool = False,
    ) -> _AttentionPlans:
        s = batch.num_extend_seqs
        decode = extend = None
        if s < batch.num_seqs:
            decode = kernels.plan_decode(
                batch.block_tables[s:],
                batch.seq_lens[s:],
                cache,
                q[batch.num_extend_tokens :],
                window,
                deterministic,
            )
        if s > 0:
            # The layer stores the new tokens' K/V before attention, as the native plan needs.
            host_lens = (batch.host_prefix_lens[:s], batch.host_extend_lens[:s])
            extend = kernels.plan_extend(
                batch.block_tables[:s],
                host_lens,
                cache,
                q[: batch.num_extend_tokens],
                window,
                deterministic,
            )
        return cls(decode, extend, window, deterministic, kernels.merge_plans(extend, decode))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused op; for 16-bit inputs torch accumulates in float32, as the references do.
    return F.rms_norm(x, weight.shape, weight, eps)


class _SafetensorsFolder:
    """Tensors by name across a folder's ``*.safetensors`` files (sharded or not)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise UnsupportedModelError(f"{path} has no *.safetensors weights")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        return self._where[name].get_tensor(name)
