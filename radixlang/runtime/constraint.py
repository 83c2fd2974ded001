"""What the engine needs from a per-request token constraint (regex, grammar, choices ...).

The engine depends on this protocol only; ``radixlang.constrain`` builds implementations
(``GrammarConstraint``, for regex, JSON schema and grammars), and callers may bring their own
through ``GenerateRequest.constraint``.
All three methods run on the engine thread, once per generated token, so they must be cheap.

A constraint may also let the model end it: ``may_end() -> bool`` (the text so far is complete
but could go on) and ``ends_on(token_id) -> bool`` (that token cannot extend it). Where
``may_end()`` holds, and ``min_new_tokens`` is met, the engine samples without the mask; a token
for which ``ends_on`` holds is dropped and the request ends with finish reason stop. Without
these, the mask always applies.

Two more optional methods make a constraint cheaper to run: a static
``batch_allowed_masks(constraints, width) -> bool [len(constraints), width]`` fills the masks of
every row of that class in one call per step, and ``forced_tokens() -> list[int]`` names the
tokens the constraint forces from here, which the engine appends at once (jump-forward) and
advances the constraint through.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TokenConstraint(Protocol):
    def allowed_mask(self) -> torch.Tensor:
        """Bool ``[n]``: the tokens that may come next. ``n`` may be below the model's logits
        width (the rest are disallowed); the engine does not modify the tensor."""
        ...

    def advance(self, token_id: int) -> None:
        """The engine appended ``token_id`` (always one the last mask allowed)."""
        ...

    def is_finished(self) -> bool:
        """Nothing more may be generated: the engine ends the request (finish reason stop)."""
        ...
