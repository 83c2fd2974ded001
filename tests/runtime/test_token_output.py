"""The rules of one new token (runtime/token_output.py) on plain requests, without an engine:
stop token, length, a constraint that finishes or fails, logprobs recorded only when asked."""

from __future__ import annotations

import pytest

from radixlang.runtime.request import FinishReason, Req
from radixlang.runtime.sampling import SamplingParams
from radixlang.runtime.token_output import ends_before, take_token

PROMPT = [5, 6, 7]


def request(max_new_tokens: int = 3, stop_ids=frozenset({2}), constraint=None, **params) -> Req:
    req = Req("r", list(PROMPT), SamplingParams(max_new_tokens=max_new_tokens, **params),
              frozenset(stop_ids), max_new_tokens, constraint=constraint)  # fmt: skip
    req.tokens = list(PROMPT)
    return req


def feed(req: Req, token: int, logprob: float | None = -0.5):
    req.tokens.append(token)
    return take_token(req, token, logprob, None, None)


def test_tokens_go_on_until_the_length_limit():
    req = request(max_new_tokens=3)
    assert [feed(req, t)[1] for t in (10, 11, 12)] == [None, None, FinishReason.LENGTH]
    assert req.first_token_time is not None and req.output_logprobs == []


def test_a_stop_token_ends_the_request_and_is_the_matched_stop():
    req = request(return_logprob=True)
    assert feed(req, 10) == ("", None)
    assert feed(req, 2) == ("", FinishReason.STOP) and req.matched_stop == 2
    assert req.output_logprobs == [-0.5, -0.5]


class Countdown:
    """A constraint of ``n`` tokens, any token but 99, which may end after the first."""

    def __init__(self, n: int) -> None:
        self.left = n

    def advance(self, token: int) -> None:
        if token == 99:
            raise ValueError("99 is not allowed")
        self.left -= 1

    def is_finished(self) -> bool:
        return self.left == 0

    def may_end(self) -> bool:
        return self.left < 2

    def ends_on(self, token: int) -> bool:
        return token == 0


def test_a_finished_constraint_stops_without_a_matched_stop():
    req = request(max_new_tokens=10, constraint=Countdown(2))
    assert feed(req, 10)[1] is None
    assert feed(req, 11)[1] is FinishReason.STOP and req.matched_stop is None


def test_a_failed_constraint_ends_with_an_error_even_on_a_stop_token():
    req = request(max_new_tokens=10, stop_ids={99}, constraint=Countdown(5))
    assert feed(req, 99)[1] is FinishReason.ERROR
    assert "99 is not allowed" in req.error


@pytest.mark.parametrize(
    ("outputs", "token", "ends"), [(0, 0, False), (1, 0, False), (2, 0, True), (2, 4, False)]
)
def test_ends_before_a_token_that_leaves_a_complete_match(outputs, token, ends):
    req = request(max_new_tokens=10, constraint=Countdown(3))
    for t in range(outputs):
        feed(req, 20 + t)
    assert ends_before(req, token) is ends
