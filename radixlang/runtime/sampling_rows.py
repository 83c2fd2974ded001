"""A step's sampling rows: each sampled request's :class:`SamplingRow`, with the allowed-token
mask its constraint gives (or token healing's first mask).

Constraints of one class fill their masks in one batched call (started beside the forward
by :meth:`SamplingRows.prefetch`, see ``grammar_masks.py``); a constraint that is done ends its
request, and one that fails (or allows no token) fails its request only, never the batch.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from radixlang.constrain import ConstraintError
from radixlang.runtime import token_output
from radixlang.runtime.grammar_masks import MaskFiller
from radixlang.runtime.request import Req
from radixlang.runtime.sampling import SamplingRow
from radixlang.runtime.scheduler import Chunk


def sampling_row(
    req: Req, mask: torch.Tensor | None = None, stop_ids: frozenset[int] | None = None
) -> SamplingRow:
    """``req``'s row in a step's :func:`~radixlang.runtime.sampling.sample` call, with an
    allowed-token ``mask`` and other ``stop_ids`` (min_new_tokens' mask) where given."""
    if mask is None and (stop_ids is None or stop_ids is req.stop_ids):
        row = req.sampling_row  # made once: its output is a live view of the tokens
        if row is None:
            row = req.sampling_row = SamplingRow(
                req.params, req.prompt_ids, req.output_view(), req.stop_ids, req.generator
            )
        return row
    return SamplingRow(
        params=req.params,
        prompt_ids=req.prompt_ids,
        output_ids=req.output_view(),
        stop_ids=req.stop_ids if stop_ids is None else stop_ids,
        generator=req.generator,
        allowed_mask=mask,
    )


class SamplingRows:
    """Makes a step's rows under constraints; ``stop(req)`` ends a request whose constraint is
    done, ``fail(req, error)`` one whose constraint failed (both on the engine thread)."""

    def __init__(
        self,
        filler: MaskFiller,
        stop: Callable[[Req], None],
        fail: Callable[[Req, Exception], None],
    ) -> None:
        self.filler = filler
        self._stop = stop
        self._fail = fail

    def for_step(
        self, chunks: list[Chunk], sampled: list[int], width: int
    ) -> tuple[list[int], list[SamplingRow]]:
        """The rows of ``sampled`` to sample now and their sampling rows: :meth:`constrained`
        where a row has a constraint, else each request's own row (token healing's first mask
        aside), with no per-row work."""
        if any(chunks[i].req.constraint is not None for i in sampled):
            return self.constrained(chunks, sampled, width)
        rows = []
        for i in sampled:
            req = chunks[i].req
            row = req.sampling_row
            if row is None or req.first_token_mask is not None:
                row = sampling_row(req, first_token_mask(req))
            rows.append(row)
        return sampled, rows

    def constrained(
        self, chunks: list[Chunk], sampled: list[int], width: int
    ) -> tuple[list[int], list[SamplingRow]]:
        """Sampling rows with each constraint's mask; requests whose constraint is done (or
        broken) are finished here instead of sampled, and left out."""
        masks: dict[int, torch.Tensor | None] = {}
        batched: dict[type, list[int]] = collections.defaultdict(list)
        for i in sampled:
            req = chunks[i].req
            if req.constraint is None:
                continue
            try:
                where = _mask_source(req)
                if where is _FINISHED:  # e.g. a regex that only matches ""
                    self._stop(req)
                elif where is _MAY_END:
                    masks[i] = None  # the model may end the match: see TokenConstraint
                elif where is _SINGLE:
                    masks[i] = _fit_mask(req.constraint.allowed_mask(), width)
                else:
                    batched[where].append(i)
            except Exception as e:  # this request's constraint failed: fail it, not the batch
                self._fail(req, e)
        for kind, rows in batched.items():
            masks.update(self._batch_masks(kind, [chunks[i].req for i in rows], rows, width))
        for i in [i for i, m in masks.items() if m is not None and not m.any()]:
            del masks[i]  # a mask that allows nothing fails its request
            self._fail(chunks[i].req, ConstraintError("the constraint allows no token here"))
        keep: list[int] = []
        rows: list[SamplingRow] = []
        for i in sampled:
            req = chunks[i].req
            if req.constraint is None:  # free text: only token healing's first mask
                keep.append(i)
                rows.append(sampling_row(req, first_token_mask(req)))
                continue
            if i not in masks:
                continue
            mask, stop_ids = masks[i], req.stop_ids
            if mask is not None and stop_ids and req.num_output < req.params.min_new_tokens:
                # min_new_tokens masks the stop tokens; where the constraint allows nothing
                # else (its text is complete), the constraint wins and may end the request.
                ids = torch.tensor([t for t in stop_ids if 0 <= t < width], dtype=torch.long)
                rest = mask.clone()
                rest[ids] = False
                if not rest.any():
                    stop_ids = frozenset()
            keep.append(i)
            rows.append(sampling_row(req, mask, stop_ids))
        return keep, rows

    def _batch_masks(
        self, kind: type, reqs: list[Req], rows: list[int], width: int
    ) -> dict[int, torch.Tensor]:
        """One call fills the masks of every row whose constraint is of class ``kind``; if it
        fails, each row is tried alone so that only the broken constraint fails its request."""
        try:
            filled = self.filler.fill(kind, [r.constraint for r in reqs], width)
            alive = filled.any(dim=1).tolist()  # one reduction for the batch
            out = {i: filled[j] for j, i in enumerate(rows) if alive[j]}
            for j, req in enumerate(reqs):
                if not alive[j]:
                    self._fail(req, ConstraintError("the constraint allows no token here"))
        except Exception:
            out = {}
            for req, i in zip(reqs, rows, strict=True):
                try:
                    out[i] = kind.batch_allowed_masks([req.constraint], width)[0]
                except Exception as e:
                    self._fail(req, e)
        return out

    def prefetch(self, chunks: list[Chunk], vocab_size: int) -> None:
        """Start filling the masks of the rows this step will sample under a batched
        constraint, so that they are ready when the forward returns (see MaskFiller)."""
        if not self.filler.overlap:
            return
        groups: dict[type, list[Any]] = collections.defaultdict(list)
        for chunk in chunks:
            req = chunk.req
            if req.constraint is None or req.finish_reason is not None:
                continue
            if chunk.end < len(req.tokens) or req.num_output >= req.output_limit:
                continue  # a prefill chunk, or nothing to sample
            try:
                where = _mask_source(req)
            except Exception:
                continue  # failed on the engine thread after the forward, as without overlap
            if isinstance(where, type):
                groups[where].append(req.constraint)
        for kind, constraints in groups.items():
            self.filler.prefetch(kind, constraints, vocab_size)


_FINISHED, _MAY_END, _SINGLE = object(), object(), object()


def _mask_source(req: Req) -> Any:
    """How a constrained request's mask is made this step: not at all (``_FINISHED``: nothing
    but the end may follow; ``_MAY_END``: unmasked, the model may end the match), alone
    (``_SINGLE``), or by its constraint's class in one batched call (that class)."""
    kind = type(req.constraint)
    if req.constraint.is_finished():
        return _FINISHED
    if token_output.may_end(req):
        return _MAY_END
    return kind if hasattr(kind, "batch_allowed_masks") else _SINGLE


def first_token_mask(req: Req) -> torch.Tensor | None:
    """Token healing's mask while the request has no output yet; None after (or without)."""
    return req.first_token_mask if req.num_output == 0 else None


def _fit_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """A constraint's mask as a bool ``[width]`` row: ids past its end are disallowed."""
    if mask.dtype != torch.bool or mask.dim() != 1 or mask.shape[0] > width:
        raise ConstraintError(
            f"allowed_mask() must be a bool tensor of at most {width} entries, "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )
    if mask.shape[0] < width:
        mask = torch.cat([mask, mask.new_zeros(width - mask.shape[0])])
    return mask
