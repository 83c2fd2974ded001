"""How ``select`` picks a choice from the model's scores of each (SGLang's three methods, and
the plain likelihood).

A backend scores every choice as a continuation of the prompt and hands the per-token
log-probabilities to a method, which returns the decision and its ``meta_info``:

- ``token_length_normalized``: the highest mean log-probability per choice token;
- ``sum_of_logprobs``: the highest total log-probability, i.e. the most likely text, with no
  allowance for length (a longer choice pays for every token it adds);
- ``greedy_token_selection``: compare token by token, keeping the choices tied for the best
  log-probability at each position (a shorter choice is padded with its own mean);
- ``unconditional_likelihood_normalized``: the highest mean of (log-probability given the prompt
  minus log-probability with no prompt), which discounts choices that are likely anyway.

Token log-probabilities are ``(logprob, token_id, token_text)`` triples (the id is None where
the service names tokens only by text, as OpenAI's completions do). Every choice is scored from
the same token position, so totals compare like with like.

A method of one's own subclasses :class:`ChoicesSamplingMethod` and returns a
:class:`ChoicesDecision`; ``sampling_scores`` says what ``select(temperature > 0)`` samples by.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TokenLogprob = tuple[float, int | None, str | None]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesSamplingMethod(ABC):
    """How ``select`` decides (SGLang's base class; ``__call__`` takes keyword arguments)."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    def sampling_scores(
        self, normalized_prompt_logprobs: list[float], input_token_logprobs: list[list[Any]]
    ) -> list[float]:
        """Per choice, the score ``select(temperature > 0)`` samples by (softmax of score /
        temperature): the mean log-probability unless the method ranks by something else."""
        return normalized_prompt_logprobs

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprob]],
        output_token_logprobs: list[list[TokenLogprob]],
        unconditional_token_logprobs: list[list[TokenLogprob]] | None = None,
    ) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return type(self).__name__


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else -math.inf


class TokenLengthNormalized(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):  # fmt: skip
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(
            choices[best],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
            },
        )


class SumOfLogprobs(ChoicesSamplingMethod):
    """The highest total log-probability: the choice the model is likeliest to write whole."""

    def sampling_scores(self, normalized_prompt_logprobs, input_token_logprobs):  # fmt: skip
        return [sum(lp for lp, _, _ in lps) for lps in input_token_logprobs]

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):  # fmt: skip
        sums = self.sampling_scores(normalized_prompt_logprobs, input_token_logprobs)
        return ChoicesDecision(
            choices[_argmax(sums)],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "sum_prompt_logprobs": sums,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
            },
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):  # fmt: skip
        width = max(len(lps) for lps in input_token_logprobs)
        matrix = []
        for lps in input_token_logprobs:
            row = [lp for lp, _, _ in lps]
            matrix.append(row + [_mean(row)] * (width - len(row)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(
            choices[remaining[0]],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "greedy_logprob_matrix": matrix,
            },
        )


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):  # fmt: skip
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for given, alone in zip(input_token_logprobs, unconditional_token_logprobs, strict=True):
            # The choice's own first token has no context when alone: count it as 0.
            alone_lps = [lp or 0.0 for lp, _, _ in alone]
            given_lps = [lp for lp, _, _ in given]
            # Align on the choice's last tokens: the prompt side may include healed tokens.
            n = min(len(given_lps), len(alone_lps))
            pairs = zip(given_lps[-n:], alone_lps[-n:], strict=True)
            scores.append(_mean([g - a for g, a in pairs]))
        return ChoicesDecision(
            choices[_argmax(scores)],
            {
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "unconditional_token_logprobs": unconditional_token_logprobs,
                "normalized_unconditional_prompt_logprobs": scores,
            },
        )


token_length_normalized = TokenLengthNormalized()
sum_of_logprobs = SumOfLogprobs()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def decide(
    choices: Sequence[str],
    scored: list[list[TokenLogprob]],
    method: ChoicesSamplingMethod,
    temperature: float,
    start: int,
    unconditional: list[list[TokenLogprob]] | None = None,
) -> ChoicesDecision:
    """A backend's last step of ``select``: ``method`` over each choice's scored tokens (from
    position ``start`` of the prompt, recorded in the meta_info). ``temperature`` > 0 samples a
    choice by the method's ``sampling_scores`` (the mean log-probability for SGLang's methods)
    instead of taking the best."""
    normalized = [sum(lp for lp, _, _ in s) / len(s) for s in scored]
    decision = method(
        choices=list(choices),
        normalized_prompt_logprobs=normalized,
        input_token_logprobs=scored,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional,
    )
    if temperature > 0:
        by = getattr(method, "sampling_scores", None)  # SGLang's own methods lack it
        scores = by(normalized, scored) if by is not None else normalized
        weights = [math.exp((x - max(scores)) / temperature) for x in scores]
        decision.decision = random.choices(list(choices), weights)[0]
    decision.meta_info["scored_from_position"] = start
    return decision
