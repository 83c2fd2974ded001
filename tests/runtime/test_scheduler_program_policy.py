"""The "program" schedule policy's starvation protection, on a fake clock: a request that waited
STARVATION_S goes before every request that did not, whatever its program's attained service;
starved requests go oldest first; before that, the least served program goes first.

The scheduler admits one request at a time here (``max_running_requests=1``), and each admitted
request is computed and finished at once, so the order of admission is the policy's order."""

from __future__ import annotations

import itertools

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.radix_cache import RadixCache
from radixlang.runtime.request import FinishReason, Req
from radixlang.runtime.sampling import SamplingParams
from radixlang.runtime.scheduler import STARVATION_S, Scheduler


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Queue:
    """A program-policy scheduler on a fake clock, with requests of distinct prompts (no two
    share a prefix, so the cache orders nothing)."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        pool = BlockPool(128, 4)
        self.scheduler = Scheduler(
            pool, RadixCache(pool), policy="program", max_running_requests=1, clock=self.clock
        )
        self._first_token = itertools.count(1, 100)

    def add(self, rid: str, program: str, prompt_len: int = 8) -> Req:
        """A request of ``program`` arriving now."""
        first = next(self._first_token)
        prompt = list(range(first, first + prompt_len))
        req = Req(rid, prompt, SamplingParams(max_new_tokens=1), frozenset(), 1,
                  arrival=self.clock(), program=program)  # fmt: skip
        self.scheduler.add(req)
        return req

    def admit_one(self) -> Req:
        """The next request admitted: its prompt computed and the request finished."""
        (chunk,) = self.scheduler.schedule().chunks
        assert chunk.start == 0 and chunk.end == len(chunk.req.tokens)  # a whole prompt
        self.scheduler.commit(chunk)
        self.scheduler.finish(chunk.req, FinishReason.LENGTH)
        return chunk.req

    def admission_order(self) -> list[str]:
        order = []
        while self.scheduler.waiting:
            order.append(self.admit_one().rid)
        self.scheduler.check_integrity()
        return order

    def serve(self, program: str, tokens: int) -> None:
        """Give ``program`` ``tokens`` of attained service by running a request of it."""
        self.add(f"warmup-{program}", program, prompt_len=tokens)
        assert self.admit_one().program == program
        assert self.scheduler.service[program] == tokens


def test_without_starvation_the_least_served_program_goes_first():
    q = Queue()
    q.serve("heavy", 40)
    q.add("heavy-1", "heavy")
    q.clock.now += STARVATION_S - 1  # it waited, but not long enough
    q.add("light-1", "light")
    assert q.admission_order() == ["light-1", "heavy-1"]


def test_a_starved_request_of_a_heavily_served_program_goes_before_a_fresh_unserved_one():
    q = Queue()
    q.serve("heavy", 40)
    q.add("heavy-1", "heavy")
    q.clock.now += STARVATION_S + 1
    q.add("light-1", "light")
    assert q.admission_order() == ["heavy-1", "light-1"]


def test_a_request_starves_as_the_clock_passes_starvation_s():
    """The same waiting request loses to fresh requests of an unserved program until it has
    waited STARVATION_S, then goes before the next one."""
    q = Queue()
    q.serve("heavy", 40)
    q.add("heavy-1", "heavy")
    q.clock.now += STARVATION_S / 2
    q.add("light-1", "light")
    assert q.admit_one().rid == "light-1"
    q.clock.now += STARVATION_S / 2 + 1  # heavy-1 has now waited STARVATION_S + 1
    q.add("light-2", "light")
    assert q.admit_one().rid == "heavy-1"
    assert q.admit_one().rid == "light-2"


def test_starved_requests_go_oldest_first_whatever_their_service():
    q = Queue()
    q.serve("heavy", 40)
    q.serve("medium", 20)
    # Queued in an order that is neither the oldest first nor the least served first.
    q.clock.now = 200.0
    q.add("medium-old", "medium")  # waits 15 s
    q.clock.now = 195.0
    q.add("heavy-oldest", "heavy")  # waits 20 s
    q.clock.now = 203.0
    q.add("light-starved", "light")  # waits 12 s: starved, and its program the least served
    q.clock.now = 210.0
    q.add("light-fresh", "light")  # waits 5 s
    q.add("fresh-new", "new")  # waits 5 s, its program unserved
    q.clock.now = 215.0
    order = q.admission_order()
    assert order[:3] == ["heavy-oldest", "medium-old", "light-starved"]
    # Then the fresh ones by service: "new" has none; "light" has light-starved's 8 tokens.
    assert order[3:] == ["fresh-new", "light-fresh"]
