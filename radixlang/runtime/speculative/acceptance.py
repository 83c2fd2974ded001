"""Which drafted tokens a request takes: one row of logits at a time, the rule that keeps the
output distribution the model's own.

For a row with a draft token ``d`` (drafts here are deterministic: one proposed token, no
draft distribution), a greedy row takes the argmax (after masks and penalties, as
:func:`~radixlang.runtime.sampling.sample` would) and accepts the draft when they are equal. A
sampled row accepts ``d`` with the probability ``p(d)`` that the row's own distribution ``p``
(temperature, top-k, top-p, min-p, masks) gives it; otherwise it draws from ``p`` with ``d``
taken out (the residual ``max(0, p - q)`` for a draft distribution ``q`` that is one-hot on
``d``). So each token comes out with exactly probability ``p``: ``d`` with ``p(d)``, any other
``t`` with ``(1 - p(d)) * p(t) / (1 - p(d))``. Rows without a draft sample as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlang.runtime.sampling import (
    SampleOutput,
    SamplingRow,
    draw_uniform,
    pick_from,
    processed_logits,
    sample,
    target_probs,
    with_logprobs,
)

NO_DRAFT = -1


def sample_with_drafts(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[int],
    generator: torch.Generator | None = None,
) -> tuple[SampleOutput, list[bool]]:
    """One token per row of ``logits`` and whether it is the row's draft, accepted
    (``drafts[i]`` is ``NO_DRAFT`` for a row without one); logprobs as :func:`sample` gives
    them (of the raw logits)."""
    n = len(rows)
    spec = [i for i in range(n) if drafts[i] != NO_DRAFT and not rows[i].params.is_greedy]
    if not spec:
        picks = sample(logits, rows, generator)
        accepted = [t == d for t, d in zip(picks.token_ids, drafts, strict=True)]
        return picks, accepted
    speculative = set(spec)
    rest = [i for i in range(n) if i not in speculative]
    token_ids = [0] * n
    logprobs: list[float | None] = [None] * n
    top: list[list[tuple[int, float]] | None] = [None] * n
    if rest:
        picks = sample(_take(logits, rest), [rows[i] for i in rest], generator)
        for j, i in enumerate(rest):
            token_ids[i], logprobs[i], top[i] = (
                picks.token_ids[j],
                picks.logprobs[j],
                picks.top_logprobs[j],
            )
    spec_rows = [rows[i] for i in spec]
    raw = _take(logits, spec).float()
    probs = target_probs(processed_logits(raw, spec_rows), [r.params for r in spec_rows])
    spec_drafts = torch.tensor([drafts[i] for i in spec], device=probs.device)
    chosen = speculative_pick(probs, spec_drafts, spec_rows, generator)
    picked = with_logprobs(raw, [r.params for r in spec_rows], chosen)
    for j, i in enumerate(spec):
        token_ids[i], logprobs[i], top[i] = (
            picked.token_ids[j],
            picked.logprobs[j],
            picked.top_logprobs[j],
        )
    accepted = [t == d for t, d in zip(token_ids, drafts, strict=True)]
    return SampleOutput(token_ids, logprobs, top), accepted


def speculative_pick(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    rows: Sequence[SamplingRow],
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Per row of ``probs`` (each row's distribution, unnormalised): its draft token with the
    probability the row gives it, else a draw from the residual."""
    total = probs.sum(dim=1)
    p_draft = probs.gather(1, drafts[:, None]).squeeze(1) / total
    u = draw_uniform(rows, generator).to(probs.device)
    accept = u < p_draft
    chosen = drafts.clone()
    rejected = (~accept).nonzero().squeeze(1)
    if len(rejected):
        residual = residual_probs(probs[rejected], drafts[rejected])
        again = draw_uniform([rows[i] for i in rejected.tolist()], generator)
        chosen[rejected] = pick_from(residual, again)
    return chosen


def residual_probs(probs: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """What a rejected row draws from: its distribution without the draft token."""
    return probs.scatter(1, drafts[:, None], 0.0)


def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    if len(idx) == x.shape[0]:
        return x
    return x[torch.tensor(idx, device=x.device)]
