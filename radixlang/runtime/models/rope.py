"""Rotary position embeddings: inverse frequencies (default, linear, llama3, longrope), the
attention scaling some types apply to cos/sin, and the rotation (of all of a head's dims, or of
its first ``rotary_dim`` only: partial rotary, as Phi-4-mini).

LongRoPE (Phi-3-mini-128k, Phi-3.5, Phi-4-mini) holds two sets of per-frequency factors: short
ones for sequences up to ``original_max_position_embeddings`` and long ones beyond. transformers
picks the set per forward call from the largest position in it (and its ``generate`` drops the
KV cache to recompute everything with the long set once a sequence crosses the boundary). A
paged, shared KV cache cannot recompute a sequence's earlier keys, so here the set is chosen
once per model, as llama.cpp does from its context size: the long factors whenever the model's
context exceeds ``original_max_position_embeddings`` (always, for the models above). Sequences
longer than that original length then get exactly transformers' rotation; shorter ones (two
tokens or more) get the long factors where transformers would use the short ones. The attention
scaling ``sqrt(1 + ln(factor) / ln(original))`` is applied to cos and sin either way, as
transformers does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_type(params: dict[str, Any]) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def inverse_frequencies(
    dim: int, params: dict[str, Any], max_context: int | None = None
) -> torch.Tensor:
    """``[dim // 2]`` float32 inverse frequencies for the config's ``rope_parameters``, ``dim``
    the rotated dims of a head. ``max_context`` (the model's context) picks LongRoPE's factor
    set (see the top)."""
    kind = rope_type(params)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if kind == "longrope":
        factors = params["long_factor" if longrope_is_long(params, max_context) else "short_factor"]
        ext = torch.tensor(factors, dtype=torch.float32)
        if ext.shape != exponents.shape:
            raise ValueError(f"longrope needs {dim // 2} factors per set; got {ext.numel()}")
        return 1.0 / (ext * base**exponents)
    inv_freq = 1.0 / (base**exponents)
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, params)
    return inv_freq


def longrope_is_long(params: dict[str, Any], max_context: int | None) -> bool:
    """Whether a LongRoPE model runs on its long factors: its context exceeds the original."""
    if max_context is None:
        raise ValueError("longrope needs the model's context to choose its factor set")
    return max_context > int(params["original_max_position_embeddings"])


def attention_scaling(params: dict[str, Any], max_context: int | None = None) -> float:
    """The factor cos and sin are multiplied by (1 but for LongRoPE), as transformers' rope
    initialisation returns it."""
    if rope_type(params) != "longrope":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # Phi-3 states its extension as the ratio of the two contexts
        if max_context is None:
            raise ValueError("longrope needs the model's context for its attention factor")
        factor = max_context / original
    factor = float(factor)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_frequencies(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends in between.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, blended, scaled)


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, 1, rotary_dim]`` cos and signed sin for ``apply_rotary`` (computed in
    float32, times ``scaling`` before the cast, as transformers does).

    The sin's first half is negated, so that the rotation needs no negation per layer.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return (
        torch.cat([cos, cos], dim=-1)[:, None, :].to(dtype),
        torch.cat([-sin, sin], dim=-1)[:, None, :].to(dtype),
    )


class RopeTable:
    """``cos_sin`` for every position up to ``max_positions``, computed once: a lookup gives a
    position the same values in any batch (deterministic inference). Computing them per batch
    may not: a vectorised cos and its scalar tail can differ in the last bit, and where an
    element falls depends on the batch's length."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_positions: int,
        dtype: torch.dtype,
        scaling: float = 1.0,
    ) -> None:
        positions = torch.arange(max_positions, device=inv_freq.device)
        cos, sin = cos_sin(inv_freq, positions, dtype, scaling)
        self.cos, self.sin = cos.contiguous(), sin.contiguous()

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


class Rotary:
    """One rotary embedding of a model (Gemma 3 has two: its local and its global layers'):
    cos and sin for a batch's positions, from a table made once when ``deterministic``."""

    def __init__(
        self,
        rotary_dim: int,
        params: dict[str, Any],
        max_context: int,
        dtype: torch.dtype,
        device: torch.device,
        deterministic: bool = False,
    ) -> None:
        self.inv_freq = inverse_frequencies(rotary_dim, params, max_context).to(device)
        self.scaling = attention_scaling(params, max_context)
        self.dtype = dtype
        self.table = (
            RopeTable(self.inv_freq, max_context, dtype, self.scaling) if deterministic else None
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.table is not None:
            return self.table.lookup(positions)
        return cos_sin(self.inv_freq, positions, self.dtype, self.scaling)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by the half-split rotary convention.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``, written as
    ``x * cos + (x2, x1) * (-sin, sin)``. Where cos covers fewer dims than a head has (partial
    rotary), the first ones are rotated and the rest pass through.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, signed_sin)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    half = rotary_dim // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
