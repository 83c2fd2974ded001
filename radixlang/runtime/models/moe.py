"""Sparse mixture-of-experts MLPs (Qwen3-MoE, Mixtral): a router picks each token's top-k
experts, and only those experts run, each on only the tokens that chose it.

The batch's (token, expert) pairs are sorted by expert; every expert that some token chose
multiplies just its rows through its own gate/up and down linears (float, int8 or q8_0/q4_0
blocks, held as the dense layers are), and the outputs go back to their tokens, weighted by the
router and summed in top-k rank order. Routing and that sum are row-wise, so a token's output
is independent of the rest of the batch wherever the linears' rows are (deterministic mode's
``InvariantLinear``). The same torch code runs on GPUs (no fused MoE kernel); the per-expert
row counts are read back to the host, so the forward is not capturable in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixlang.model_files import UnsupportedModelError


class _Linear(Protocol):
    num_bytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Expert:
    gate_up: _Linear  # hidden -> 2 * width (gate rows, then up rows)
    down: _Linear  # width -> hidden


@dataclass
class SparseMLP:
    """One layer's router and experts."""

    router: _Linear  # hidden -> num_experts
    experts: list[Expert]
    top_k: int
    # Renormalise the chosen experts' probabilities to sum to 1 (Mixtral always; Qwen3-MoE
    # under norm_topk_prob): the same as a softmax over the chosen logits alone.
    normalize: bool

    @property
    def num_bytes(self) -> int:
        experts = sum(e.gate_up.num_bytes + e.down.num_bytes for e in self.experts)
        return self.router.num_bytes + experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts ``[tokens, k]`` (in descending probability) and their
        weights (float32), as transformers computes them: softmax in float32, top-k, then the
        optional renormalisation."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(
        self, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The layer's MLP output for ``x`` ``[tokens, hidden]``."""
        tokens, hidden = x.shape
        k = self.top_k
        weights, ids = self.route(x)
        pairs = ids.reshape(-1)  # pair j of token t at t * k + j
        # Grouped by expert; stable, so each expert's rows keep the tokens' order.
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        rows = x.index_select(0, order // k)
        out = torch.empty_like(rows)
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                gate, up = expert.gate_up(rows[start : start + n]).chunk(2, dim=-1)
                out[start : start + n] = expert.down(activation(gate) * up)
            start += n
        # Back to (token, rank) order; a token's k outputs summed one rank at a time in float32
        # (elementwise, so no reduction whose order could depend on the batch's shape).
        per_pair = torch.empty_like(out).index_copy_(0, order, out).view(tokens, k, hidden)
        total = per_pair[:, 0].float() * weights[:, :1]
        for j in range(1, k):
            total += per_pair[:, j].float() * weights[:, j : j + 1]
        return total.to(x.dtype)


# Where checkpoints keep a sparse layer's router and experts, under the layer's prefix:
# (module, expert gate, up, down) per expert, as released checkpoints and transformers'
# save_pretrained store them (Qwen3-MoE's names; Mixtral's w1/w3/w2 under block_sparse_moe).
PER_EXPERT_NAMES = (
    ("mlp", "gate_proj", "up_proj", "down_proj"),
    ("block_sparse_moe", "w1", "w3", "w2"),
    ("mlp", "w1", "w3", "w2"),  # Mixtral's with transformers 5's module renamed
)


# A GGUF file's experts (gguf_weights.py): gate, up and down each one 3-D tensor.
GGUF_EXPERT_NAMES = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")


def load_sparse_mlp(
    weights: Any,
    prefix: str,
    arch: Any,
    stacked: Callable[[list[torch.Tensor]], _Linear],
    router: Callable[[torch.Tensor], _Linear],
    expert_linear: Callable[[list[str], int], _Linear] | None = None,
) -> SparseMLP:
    """The sparse MLP of the layer at ``prefix`` (``model.layers.{i}.``): per-expert matrices
    (``PER_EXPERT_NAMES``), transformers 5's fused 3-D ``mlp.experts.gate_up_proj``
    ``[experts, 2 * width, hidden]`` and ``mlp.experts.down_proj`` ``[experts, hidden, width]``,
    or a GGUF file's 3-D gate, up and down (``GGUF_EXPERT_NAMES``).
    ``stacked`` makes one linear of matrices stacked by rows (held as the model's quantization
    says), ``router`` the router's linear, ``expert_linear(names, e)`` one linear of expert
    ``e``'s matrices of the named 3-D tensors stacked by rows (a GGUF file's: each expert held
    as its own slice of the file's blocks, the tensor never read whole)."""
    n = arch.num_experts
    gate_name = next(
        (f"{prefix}{m}.gate.weight" for m in ("mlp", "block_sparse_moe")
         if weights.has(f"{prefix}{m}.gate.weight")),
        None,
    )  # fmt: skip
    if gate_name is None:
        raise UnsupportedModelError(f"the router of {prefix.rstrip('.')} is missing")
    gate = weights.get(gate_name)
    if gate.shape[0] != n:
        raise UnsupportedModelError(f"{gate_name} routes to {gate.shape[0]} experts, not {n}")
    experts: list[Expert] = []
    fused = f"{prefix}mlp.experts.gate_up_proj"
    gguf = [prefix + name for name in GGUF_EXPERT_NAMES]
    if weights.has(gguf[0]):
        if expert_linear is None:
            raise UnsupportedModelError(f"{gguf[0]} needs a loader of experts' matrices")
        for name in gguf:
            if not weights.has(name) or weights.shape_of(name)[0] != n:
                raise UnsupportedModelError(f"{name} is missing or does not hold {n} experts")
        experts = [Expert(expert_linear(gguf[:2], e), expert_linear(gguf[2:], e)) for e in range(n)]
    elif weights.has(fused):
        gate_up, down = weights.get(fused), weights.get(f"{prefix}mlp.experts.down_proj")
        if gate_up.shape[0] != n or down.shape[0] != n:
            raise UnsupportedModelError(f"{fused} holds {gate_up.shape[0]} experts, not {n}")
        experts = [Expert(stacked([gate_up[e]]), stacked([down[e]])) for e in range(n)]
    else:
        for module, g, u, d in PER_EXPERT_NAMES:
            base = f"{prefix}{module}.experts."
            if not weights.has(f"{base}0.{g}.weight"):
                continue
            for e in range(n):
                names = [f"{base}{e}.{w}.weight" for w in (g, u, d)]
                parts = [weights.get(name) for name in names]
                experts.append(Expert(stacked(parts[:2]), stacked(parts[2:])))
            break
        else:
            raise UnsupportedModelError(f"the experts of {prefix.rstrip('.')} are missing")
    return SparseMLP(router(gate), experts, arch.experts_per_token, arch.norm_topk_prob)
