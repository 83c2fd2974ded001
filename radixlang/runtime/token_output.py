"""What one new token of a request means: its logprobs recorded, its constraint advanced, its
text (through the request's detokenizer), and whether the request ends on it and why (a stop
token, a stop string, a finished or failed constraint, the length limit).

The engine thread calls :func:`take_token` for every sampled token and then pushes the stream
event and finishes the request itself; nothing here touches the engine, the scheduler or a
handle, so each rule can be read, and tested, on its own."""

from __future__ import annotations

import time

from radixlang.runtime.detokenizer import IncrementalDetokenizer
from radixlang.runtime.request import FinishReason, Req, TopLogprobs


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
