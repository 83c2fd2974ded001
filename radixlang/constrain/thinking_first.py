"""The constraint of a reasoning model's request: optional thinking first (free, bounded by a
budget), then the answer under the request's own constraint (see ``reasoning.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from radixlang.constrain.reasoning import ReasoningMarkers


class ThinkingFirst:
    """A ``TokenConstraint`` for a reasoning model's request: optional thinking first, then
    ``inner`` (None: the answer is free).

    Phases: *start* (the first token: ``<think>`` opens a block, anything else is the answer's
    first token, which ``inner`` must allow), *thinking* (anything but the end of the output;
    ``</think>`` ends it; past ``budget`` tokens ``</think>`` is forced), *gap* (the whitespace
    the template writes after ``</think>``, ``markers.after_close``, token by token, which the
    model may write or skip: not the answer's), *answer* (``inner``'s).
    """

    def __init__(
        self,
        inner: Any,
        markers: ReasoningMarkers,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        budget: int | None = None,
        opened: bool = False,
    ) -> None:
        self.inner = inner
        self.markers = markers
        self.vocab_size = vocab_size
        self.budget = budget
        self.phase = "thinking" if opened else "start"
        self.thinking_tokens = 0
        self.gap_tokens = 0  # of markers.after_close written
        self._eos = [t for t in eos_token_ids if 0 <= t < vocab_size]

    # -- the protocol -------------------------------------------------------------------------
    def allowed_mask(self) -> torch.Tensor:
        if self.phase == "answer":
            return self._inner_mask()
        if self.phase == "gap":
            mask = self._inner_mask().clone()
            mask[self.markers.after_close[self.gap_tokens]] = True
            return mask
        if self.phase == "thinking":
            if self._spent():
                mask = torch.zeros(self.vocab_size, dtype=torch.bool)
                mask[self.markers.close_id] = True
                return mask
            mask = torch.ones(self.vocab_size, dtype=torch.bool)
            mask[self._eos] = False  # the output may not end inside its thinking
            mask[self.markers.open_id] = False
            return mask
        mask = self._inner_mask().clone()  # start: the answer's first token, or a thinking block
        mask[self.markers.open_id] = True
        mask[self.markers.close_id] = False
        return mask

    def advance(self, token_id: int) -> None:
        if self.phase == "answer":
            if self.inner is not None:
                self.inner.advance(token_id)
        elif self.phase == "gap":
            if token_id == self.markers.after_close[self.gap_tokens]:
                self.gap_tokens += 1
                if self.gap_tokens == len(self.markers.after_close):
                    self.phase = "answer"
            else:
                self.phase = "answer"
                if self.inner is not None:
                    self.inner.advance(token_id)
        elif self.phase == "thinking":
            if token_id == self.markers.close_id:
                self.phase = "gap" if self.markers.after_close else "answer"
            else:
                self.thinking_tokens += 1
        elif token_id == self.markers.open_id:
            self.phase = "thinking"
        else:
            self.phase = "answer"
            if self.inner is not None:
                self.inner.advance(token_id)

    def is_finished(self) -> bool:
        return self.phase == "answer" and self.inner is not None and self.inner.is_finished()

    def forced_tokens(self) -> list[int]:
        if self.phase == "thinking" and self._spent():
            return [self.markers.close_id]
        if self.phase == "answer" and hasattr(self.inner, "forced_tokens"):
            return list(self.inner.forced_tokens())
        return []

    def may_end(self) -> bool:
        if self.phase not in ("answer", "gap"):
            return False
        if self.inner is None:
            return True
        return bool(getattr(self.inner, "may_end", lambda: False)())

    def ends_on(self, token_id: int) -> bool:
        if self.phase != "answer" or self.inner is None:
            return False
        return bool(getattr(self.inner, "ends_on", lambda _t: False)(token_id))

    # -- helpers ------------------------------------------------------------------------------
    def _spent(self) -> bool:
        return self.budget is not None and self.thinking_tokens >= self.budget

    def _inner_mask(self) -> torch.Tensor:
        if self.inner is None:
            return torch.ones(self.vocab_size, dtype=torch.bool)
        mask = self.inner.allowed_mask()
        if mask.shape[0] < self.vocab_size:
            mask = torch.cat([mask, mask.new_zeros(self.vocab_size - mask.shape[0])])
        return mask[: self.vocab_size]
