"""What one new token of a request means: its logprobs recorded, its constraint advanced, its
text (through the request's detokenizer), and whether the request ends on it and why (a stop
token, a stop string, a finished or failed constraint, the length limit); and the prompt
logprobs a prefill chunk owes.

The engine thread calls :func:`take_token` for every sampled token and then pushes the stream
event and finishes the request itself; nothing here touches the engine, the scheduler or a
handle, so each rule can be read, and tested, on its own."""

from __future__ import annotations

import time
from typing import Any

import torch

from radixlang.runtime.detokenizer import IncrementalDetokenizer
from radixlang.runtime.request import FinishReason, Req, TopLogprobs
from radixlang.runtime.scheduler import Chunk


def take_token(
    req: Req,
    token: int,
    logprob: float | None,
    top: TopLogprobs | None,
    detok: IncrementalDetokenizer | None,
    position: int | None = None,
) -> tuple[str, FinishReason | None]:
    """Take ``token``, the last real one of ``req.tokens`` (at ``position``; placeholders may
    follow it): the text it completes and the reason the request ends on it (None: it goes
    on). A failed constraint sets ``req.error`` and ends the request with ERROR."""
    constraint = req.constraint
    if req.first_token_time is None:
        req.first_token_time = time.perf_counter()
    params = req.params
    if params.return_logprob:
        req.output_logprobs.append(logprob)
        req.output_top_logprobs.append(top)
    constraint_done = constraint_failed = False
    if constraint is not None:
        try:
            constraint.advance(token)
            constraint_done = constraint.is_finished()
        except Exception as e:
            req.error = f"constraint: {type(e).__name__}: {e}"
            constraint_failed = True
    reason = None
    num_output = (len(req.tokens) if position is None else position + 1) - len(req.prompt_ids)
    if token in req.stop_ids and not constraint_failed:
        reason, req.matched_stop = FinishReason.STOP, token
        text = detok.flush() if detok else ""
        return text, reason
    check_stop = num_output >= params.min_new_tokens
    text = detok.push(token, check_stop=check_stop) if detok else ""
    if constraint_failed:
        reason = FinishReason.ERROR
        if detok is not None:
            text += detok.flush(check_stop=False)
    elif detok is not None and detok.stopped:
        reason, req.matched_stop = FinishReason.STOP, detok.matched_stop
    elif constraint_done or num_output >= req.output_limit:
        # A finished constraint ends the request as a stop with no matched stop.
        reason = FinishReason.STOP if constraint_done else FinishReason.LENGTH
        if detok is not None:
            text += detok.flush(check_stop=check_stop)
            if detok.stopped:  # the stop ended in text held back until now
                reason, req.matched_stop = FinishReason.STOP, detok.matched_stop
    return text, reason


def may_end(req: Req) -> bool:
    """Whether ``req``'s constraint is complete here and the model may end it (past its
    ``min_new_tokens``)."""
    check = getattr(req.constraint, "may_end", None)
    return check is not None and req.num_output >= req.params.min_new_tokens and bool(check())


def ends_before(req: Req, token: int) -> bool:
    """Whether ``req`` ends without ``token``: its constraint is complete and the token would
    leave it (see ``TokenConstraint.ends_on``). Raises what the constraint raises."""
    ends_on = getattr(req.constraint, "ends_on", None)
    return ends_on is not None and may_end(req) and bool(ends_on(token))


def collect_prompt_logprobs(chunk: Chunk, last: torch.Tensor, out: Any, i: int) -> None:
    """Record the log-probabilities of the chunk's prompt positions that are owed (row ``i``
    of the forward's ``out``; ``last`` its last logits row, which scores the next chunk's
    first token)."""
    req = chunk.req
    k = req.params.top_logprobs_num
    # Read back once (not a device sync per position).
    values = out.prompt_logprobs[i].tolist()
    top = out.prompt_top_logprobs[i]
    top_ids, top_values = (top[1].tolist(), top[0].tolist()) if top else ([], [])
    end = min(chunk.end, req.prompt_len)
    for pos in range(req.next_prompt_logprob, end):
        token = req.tokens[pos]
        if pos == chunk.start:  # scored by the previous chunk's last row
            scores = req.boundary_scores
            assert scores is not None, "a prompt chunk boundary lost its scores"
            req.prompt_logprobs.append((token, float(scores[token])))
            if k:
                v, ids = scores.topk(k)
                req.prompt_top_logprobs.append(_pairs(ids, v))
            else:
                req.prompt_top_logprobs.append(None)
            continue
        row = pos - chunk.start - 1
        req.prompt_logprobs.append((token, values[row]))
        req.prompt_top_logprobs.append(
            list(zip(top_ids[row], top_values[row], strict=True)) if top else None
        )
    if end < req.prompt_len:
        # The next chunk starts at `end`: its first token is scored by this chunk's last row,
        # if that position is owed (a chunk may end before the first position to score).
        req.next_prompt_logprob = max(req.next_prompt_logprob, end)
        owed = req.next_prompt_logprob == end
        req.boundary_scores = torch.log_softmax(last.float(), dim=-1) if owed else None
    else:
        req.next_prompt_logprob = -1
        req.boundary_scores = None


def _pairs(ids: torch.Tensor, values: torch.Tensor) -> TopLogprobs:
    return [(int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist(), strict=True)]
