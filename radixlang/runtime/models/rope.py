"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and rotation."""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies for the config's ``rope_parameters``."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, params)
    return inv_freq


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
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tokens, 1, head_dim]`` cos and signed sin for ``apply_rotary`` (computed in float32).

    The sin's first half is negated, so that the rotation needs no negation per layer.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return (
        torch.cat([cos, cos], dim=-1)[:, None, :].to(dtype),
        torch.cat([-sin, sin], dim=-1)[:, None, :].to(dtype),
    )


class RopeTable:
    """``cos_sin`` for every position up to ``max_positions``, computed once: a lookup gives a
    position the same values in any batch (deterministic inference). Computing them per batch
    may not: a vectorised cos and its scalar tail can differ in the last bit, and where an
    element falls depends on the batch's length."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype) -> None:
        positions = torch.arange(max_positions, device=inv_freq.device)
        cos, sin = cos_sin(inv_freq, positions, dtype)
        self.cos, self.sin = cos.contiguous(), sin.contiguous()

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by the half-split rotary convention.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``, written as
    ``x * cos + (x2, x1) * (-sin, sin)``.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
