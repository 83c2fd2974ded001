"""A step's tokens when some of its decodes carried drafts: taken one position at a time.

Round ``j`` samples, for every request still going, the logits after its ``j``-th computed
token: round 0 is the step every request takes anyway (its masks, penalties and stops as
without drafts); a request goes on to round ``j + 1`` only when its token equals its ``j``-th
draft token (accepted by ``acceptance.py``'s rule) and it did not end on it. Each token is
appended through the engine's usual path (stop tokens and strings, constraints, logprobs,
stream events), so a request's rows see exactly the output a step without drafts would have
given them; an accepted token's KV, already written by the forward, is counted computed. What
verification rejects is rolled back: its KV slots lie past the computed tokens (the next step
writes over them) and the blocks taken only for it go back to the pool, so nothing
unverified reaches the radix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from radixlang.runtime.request_outputs import RequestOutputs
from radixlang.runtime.sampling_rows import SamplingRows
from radixlang.runtime.scheduler import Chunk, Scheduler
from radixlang.runtime.speculative.acceptance import NO_DRAFT, sample_with_drafts
from radixlang.runtime.speculative.drafter import Drafter


class DraftVerifier:
    """Takes a step's sampled rows, drafts verified (see the module)."""

    def __init__(
        self,
        scheduler: Scheduler,
        outputs: RequestOutputs,
        rows: SamplingRows,
        drafter: Drafter,
        generator: Callable[[], torch.Generator],
        jump_forward: Callable[[], bool],
    ) -> None:
        self.scheduler = scheduler
        self.outputs = outputs
        self.rows = rows
        self.drafter = drafter
        self._generator = generator
        self._jump_forward = jump_forward

    def take(self, chunks: list[Chunk], sampled: list[int], out: Any) -> int:
        """Sample and append the tokens of rows ``sampled`` of the step's ``out``; how many
        tokens were appended."""
        generator = self._generator()
        jump_forward = self._jump_forward()
        append = self.outputs.append
        width = out.logits.shape[-1]
        accepted = {i: 0 for i in sampled if chunks[i].draft}
        rejected: set[int] = set()
        appended = 0
        active = sampled
        position = 0
        while active:
            keep, rows = self.rows.for_step(chunks, active, width)
            if not keep:
                break
            logits = torch.stack([_row(chunks[i], out, i, position) for i in keep])
            drafts = [_draft_at(chunks[i], position) for i in keep]
            picks, taken = sample_with_drafts(logits, rows, drafts, generator)
            going = []
            for row, i in enumerate(keep):
                req = chunks[i].req
                append(req, picks.token_ids[row], picks.logprobs[row], picks.top_logprobs[row])
                appended += 1
                if taken[row] and req.finish_reason is None:
                    self.scheduler.commit_draft(req)  # its KV is the forward's
                    accepted[i] += 1
                    going.append(i)
                    continue
                if drafts[row] != NO_DRAFT and not taken[row]:
                    rejected.add(i)
                if jump_forward and req.constraint is not None and req.finish_reason is None:
                    appended += self.outputs.jump_forward(req)
            active = going
            position += 1
        self.drafter.counters.verify_steps += 1
        for i, count in accepted.items():
            chunk = chunks[i]
            self.drafter.verified(chunk.req, len(chunk.draft), count, i in rejected)
            if chunk.req.finish_reason is None:
                self.scheduler.drop_draft_blocks(chunk.req)
        return appended


def _row(chunk: Chunk, out: Any, i: int, position: int) -> torch.Tensor:
    """The logits after the chunk's ``position``-th computed token (0: its own token)."""
    if chunk.draft:
        return out.token_logits[i][position]
    return out.logits[i]


def _draft_at(chunk: Chunk, position: int) -> int:
    draft = chunk.draft
    return draft[position] if position < len(draft) else NO_DRAFT
