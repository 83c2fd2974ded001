"""Random programs of engine operations: submit, step, abort, flush and pool pressure.

A hypothesis state machine drives a stepped engine (``background=False``) on a tiny random
llama that carries the default model's tokenizer (so stop strings and regexes work). Requests
use prompts that share random prefixes (some ending inside a block), greedy, seeded and unseeded
sampling, stop strings (some cut from the request's own output, so that they do match), regexes,
output and prompt logprobs, prefill-only prompts (``max_new_tokens=0``), cache salts and
``n > 1`` (n requests of one prompt, seeds ``seed + j``, as the server sends them).

The pool is shrunk in two ways: each program builds its engine with a pool drawn from a few
sizes (down to prompts that do not fit and are refused), and rules take free blocks out of the
pool (held by the test, as another tenant would) and give them back later. The held blocks are
counted as holders outside the tree (``external_refs``), so the engine's exact check still holds.

After every rule: the engine's ``check_integrity`` (tree, counters, pool, requests), an exact
reference count computed here (every block's refcount equals its holders: tree nodes, running
requests' block tables and the test's held blocks; free blocks are exactly those with none),
and every request accounted for (queued, waiting, running or finished with a result). Every
finished request is checked: greedy and seeded (top-k) ones give exactly what the same request
gives run alone on an engine with a pool of the same size (an aborted one a prefix of it; one
that ran while blocks were held may be cut short by the smaller pool, to a prefix), a regex that
ended the request fully matches the text, logprob lists match the outputs, a prefill-only
prompt is cached, and the stream adds up to the result. At teardown every request is
finished, the cache flushes and every block is free.

CI runs 40 programs of up to 40 rules (about 20 s); ``RADIXLANG_STATEFUL_SCALE=10`` runs ten
times as many (about 6 minutes):

    RADIXLANG_STATEFUL_SCALE=10 .venv/bin/pytest tests/runtime/test_engine_stateful.py -q
"""

from __future__ import annotations

import os
import random
import re
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from tiny_models import PINNED_STEP_COST_MS, make_tiny_llama_with_tokenizer

from radixlang.runtime import engine as engine_module
from radixlang.runtime.block_pool import RELEASED, blocks_for
from radixlang.runtime.engine import CacheBusyError, Engine, RequestError
from radixlang.runtime.handle import RequestHandle
from radixlang.runtime.request import FinishReason, GenerationResult, ReqStatus

load_tokenizer = engine_module._load_tokenizer
SCALE = int(os.environ.get("RADIXLANG_STATEFUL_SCALE", "1"))
BLOCK = 4
POOL_SIZES = (9, 20, 64)  # blocks of 4 tokens: a 36-token prompt does not fit the smallest
REGEXES = (r"(yes|no)", r"[0-9]{1,4}", r"(the|a) (cat|dog)!")
LITERAL_STOPS = (" ", "e", ",")
LOGPROB_TOL = 1e-4

# Prompt families: a prompt is the head of one of them plus a short tail from a small alphabet,
# so that prompts share prefixes, diverge inside blocks, and sometimes repeat.
_rng = random.Random(0)
FAMILIES = [[_rng.randrange(300, 8000) for _ in range(32)] for _ in range(3)]
TAIL = (301, 302, 303)


@st.composite
def prompts(draw) -> list[int]:
    head = draw(st.sampled_from(FAMILIES))[: draw(st.integers(0, 32))]
    tail = draw(st.lists(st.sampled_from(TAIL), min_size=0 if head else 1, max_size=5))
    return head + tail


@st.composite
def requests(draw) -> dict:
    """A request's sampling parameters; ``stop_at`` (an index) asks for a stop string cut
    from the output the request gives without one."""
    mode = draw(st.sampled_from(["greedy", "greedy", "seeded", "unseeded"]))
    p: dict = {"max_new_tokens": draw(st.sampled_from([0, 1, 4, 12, 24, 24]))}
    if mode == "greedy":
        p["temperature"] = 0
    else:
        p["temperature"] = 1.0
        if mode == "seeded":
            # Compared with the request run alone: over the whole, nearly flat vocabulary a
            # logit that differs in float32 rounding (another chunking, a cached prefix) moves
            # the draw to the neighbouring token, so seeded requests sample from the top k.
            p |= {"seed": draw(st.integers(0, 3)), "top_k": draw(st.sampled_from([5, 20]))}
        else:
            p["top_k"] = draw(st.sampled_from([-1, 20]))
    p["ignore_eos"] = draw(st.booleans())
    shape = draw(st.sampled_from(["free", "free", "stop", "regex"]))
    if shape == "regex":
        p["regex"] = draw(st.sampled_from(REGEXES))
    elif shape == "stop":
        literal = draw(st.sampled_from([*LITERAL_STOPS, None]))
        p["stop"] = [literal] if literal else []
        p["stop_at"] = None if literal else draw(st.integers(0, 40))
    if draw(st.booleans()):
        p["return_logprob"] = True
        p["top_logprobs_num"] = draw(st.sampled_from([0, 2]))
        p["logprob_start_len"] = draw(st.sampled_from([-1, 0, 5]))
    return p


@dataclass
class Sub:
    """One submitted request and what the test knows of it."""

    handle: RequestHandle
    prompt: list[int]
    params: dict
    salt: str
    evicted_at_submit: int
    aborted: bool = False
    pressured: bool = False  # blocks were held while it was in flight
    checked: bool = False
    cached_at_finish: int | None = None  # prefix of the prompt cached when it finished
    events: list = field(default_factory=list)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self, folder, shared: dict, speculative: str = "off") -> None:
        super().__init__()
        self.folder = folder
        # With speculative decoding on, the engine under test drafts (deterministic mode, so
        # that a verified token's logits are bitwise a decode's; its step cost pinned, so that
        # what it drafts does not depend on the machine's load); the reference does not.
        self.speculative = speculative
        self.extra = (
            {
                "speculative": "ngram",
                "deterministic": True,
                "speculative_step_cost_ms": PINNED_STEP_COST_MS,
            }
            if speculative != "off"
            else {}
        )
        # Shared across programs: num_blocks -> reference engine, and the results run alone.
        self.references = shared.setdefault("engines", {})
        self.alone_cache = shared.setdefault("alone", {})
        self.shared = shared
        self.eng: Engine | None = None
        self.subs: list[Sub] = []
        self.held: list[int] = []
        self.counter = 0

    # ---- the engine and its reference ----------------------------------------------------
    @initialize(
        num_blocks=st.sampled_from(POOL_SIZES),
        max_batch_tokens=st.sampled_from([6, 16, 256]),
        max_running=st.sampled_from([2, 4, 64]),
        policy=st.sampled_from(["lpm", "dfs-weight", "fcfs"]),
    )
    def build(self, num_blocks: int, max_batch_tokens: int, max_running: int, policy: str):
        self.eng = engine(
            self.folder,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_running_requests=max_running,
            schedule_policy=policy,
            **self.extra,
        )
        scheduler = self.eng.scheduler
        own = scheduler.external_refs

        def with_held() -> Counter[int]:  # the test's blocks are holders outside the tree
            refs = own()
            refs.update(self.held)
            return refs

        scheduler.external_refs = with_held  # type: ignore[method-assign]

    def alone(self, prompt: list[int], params: dict) -> GenerationResult:
        """The request run alone on a fresh cache of an engine with a pool of the same size."""
        num_blocks = self.eng.pool.num_blocks
        key = (num_blocks, tuple(prompt), repr(sorted(params.items())))
        if key not in self.alone_cache:
            ref = self.references.get(num_blocks)
            if ref is None:
                deterministic = bool(self.extra)
                ref = self.references[num_blocks] = engine(
                    self.folder, num_blocks=num_blocks, deterministic=deterministic
                )
            ref.flush_cache()
            self.alone_cache[key] = ref.generate(prompt, params)
            ref.check_integrity()
        return self.alone_cache[key]

    def engine_params(self, prompt: list[int], p: dict) -> dict:
        p = dict(p)
        stop_at = p.pop("stop_at", None)
        fits = blocks_for(len(prompt) + 1, BLOCK) <= self.eng.pool.num_blocks
        if "stop" in p and not p["stop"] and fits:
            text = self.alone(prompt, p).text if "seed" in p or p["temperature"] == 0 else ""
            if len(text) >= 2:
                i = stop_at % (len(text) - 1)
                p["stop"] = [text[i : i + 2]]
        return p

    # ---- rules ---------------------------------------------------------------------------
    @precondition(lambda self: self.eng is not None)
    @rule(
        prompt=prompts(),
        params=requests(),
        n=st.sampled_from([1, 1, 1, 2, 3]),
        salt=st.sampled_from(["", "", "t"]),
    )
    def submit(self, prompt: list[int], params: dict, n: int, salt: str) -> None:
        eng = self.eng
        base = self.engine_params(prompt, params)
        need = blocks_for(len(prompt) + (base["max_new_tokens"] > 0), BLOCK)
        for j in range(n):
            p = dict(base)
            if n > 1 and "seed" in p:
                p["seed"] += j  # n samples, not n copies of one
            sub = Sub(None, prompt, p, salt, eng.cache.evicted_blocks_total)  # type: ignore[arg-type]
            sub.pressured = bool(self.held)
            self.counter += 1
            rid = f"r{self.counter}"

            def on_event(event, sub=sub) -> None:
                sub.events.append(event)
                if event.finished:  # before any later step can evict it
                    sub.cached_at_finish = eng.cache.peek_prefix_len(sub.prompt, sub.salt)

            try:
                sub.handle = eng.submit(
                    prompt, p, request_id=rid, on_event=on_event, cache_salt=salt
                )
            except RequestError as e:
                assert need > eng.pool.num_blocks, f"refused a request that fits: {e}"
                return
            assert need <= eng.pool.num_blocks, "took a prompt larger than the pool"
            self.subs.append(sub)

    @precondition(lambda self: self.eng is not None)
    @rule(prompt=prompts(), params=requests())
    def submit_one(self, prompt: list[int], params: dict) -> None:
        """Submissions come twice as often as other operations."""
        self.submit(prompt, params, 1, "")

    @precondition(lambda self: self.eng is not None)
    @rule(k=st.integers(1, 16))
    def step(self, k: int) -> None:
        for _ in range(k):
            self.eng.step()

    @precondition(lambda self: any(not s.handle.done for s in self.subs))
    @rule(i=st.integers(0, 1000))
    def abort(self, i: int) -> None:
        live = [s for s in self.subs if not s.handle.done]
        sub = live[i % len(live)]
        sub.aborted = True
        sub.handle.abort()

    @precondition(lambda self: self.eng is not None)
    @rule()
    def flush(self) -> None:
        """A flush with requests in flight is refused and changes nothing; otherwise it
        empties the cache."""
        eng = self.eng
        tokens_before = eng.cache.cached_tokens
        try:
            assert eng.flush_cache() is True
        except CacheBusyError:
            assert eng.scheduler.has_work()
            assert eng.cache.cached_tokens == tokens_before
            return
        assert not eng.scheduler.has_work()
        assert eng.cache.cached_tokens == 0
        assert eng.pool.num_free == eng.pool.num_blocks - len(self.held)

    @precondition(lambda self: self.eng is not None and not self.held)
    @rule()
    def finish_all_and_flush(self) -> None:
        """flush_cache(wait=...) runs the steps until every request is done, then flushes."""
        try:
            assert self.eng.flush_cache(wait=60.0) is True
        except CacheBusyError:
            raise AssertionError(f"requests never finish: {self.stuck()}") from None
        assert all(s.handle.done for s in self.subs)
        assert self.eng.pool.num_free == self.eng.pool.num_blocks

    @precondition(lambda self: self.eng is not None)
    @rule(k=st.integers(-12, 12))
    def resize_pool(self, k: int) -> None:
        """Shrink the pool by ``k`` blocks (taking free ones, after evicting cached prefixes
        for them) or, with ``k < 0``, give back ``-k`` of those taken."""
        eng = self.eng
        if k < 0:
            back, self.held = self.held[:-k], self.held[-k:]
            eng.pool.decref(back)
            return
        if k > eng.pool.num_free:
            eng.cache.evict(k - eng.pool.num_free)
        self.held += eng.pool.alloc(min(k, eng.pool.num_free))
        if self.held:
            for s in self.subs:
                if not s.handle.done:
                    s.pressured = True

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        eng = self.eng
        if eng is None:
            return
        eng.check_integrity()
        # Exact reference counts, counted here: tree nodes + running requests + held blocks.
        holders: Counter[int] = Counter(self.held)
        for node in eng.cache.nodes_parents_first():
            holders.update(node.blocks)
        for req in eng.scheduler.running:
            holders.update(b for b in req.blocks if b != RELEASED)
        pool = eng.pool
        for b in range(pool.num_blocks):
            assert pool.refcount(b) == holders[b], (b, pool.refcount(b), holders[b])
        assert pool.num_free == sum(1 for b in range(pool.num_blocks) if not holders[b])
        for req in eng.scheduler.waiting:
            assert not req.blocks and req.handle is None

    @invariant()
    def every_request_accounted_for(self) -> None:
        eng = self.eng
        if eng is None:
            return
        queued = {item[0].rid for kind, item in eng._inbox if kind == "add"}
        running = {r.rid for r in eng.scheduler.running}
        waiting = {r.rid for r in eng.scheduler.waiting}
        assert not running & waiting
        for s in self.subs:
            rid = s.handle.request_id
            if s.handle.done:
                assert rid not in running | waiting
            else:
                assert rid in queued | running | waiting, f"request {rid} was lost"
                req = eng._reqs.get(rid)
                if req is not None:
                    want = ReqStatus.RUNNING if rid in running else ReqStatus.WAITING
                    assert req.status is want

    @invariant()
    def finished_requests_are_right(self) -> None:
        for s in self.subs:
            if s.handle.done and not s.checked:
                s.checked = True
                self.check_result(s)

    @staticmethod
    def cut(s: Sub, r: GenerationResult) -> bool:
        """Whether the request may have ended early: aborted, or cut short (``length``) by the
        blocks the test held, where its next token found no block. Alone in a pool of the same
        size, a sequence that outgrows the pool ends at the same token."""
        if r.finish_reason is FinishReason.ABORT:
            return True
        return s.pressured and r.finish_reason is FinishReason.LENGTH

    def check_result(self, s: Sub) -> None:
        r = s.handle.result(raise_on_error=False)
        p = s.params
        why = (s.prompt, p, r.finish_reason, r.output_ids, r.cached_tokens, s.cached_at_finish)
        assert r.error is None and r.finish_reason is not FinishReason.ERROR, r.error
        assert r.finish_reason is not FinishReason.ABORT or s.aborted
        assert r.prompt_ids == s.prompt
        assert len(r.output_ids) <= p["max_new_tokens"]
        assert r.completion_tokens == len(r.output_ids)
        # The stream adds up to the result and ends with one finished event.
        assert [t for e in s.events for t in e.token_ids] == r.output_ids
        assert "".join(e.text for e in s.events) == r.text
        assert s.events and s.events[-1].finished and not any(e.finished for e in s.events[:-1])
        if p.get("return_logprob"):
            assert len(r.output_logprobs) == len(r.output_top_logprobs) == len(r.output_ids)
            k = p["top_logprobs_num"]
            for top in r.output_top_logprobs:
                assert len(top or []) == k
            start = p["logprob_start_len"]
            if start >= 0 and not self.cut(s, r):
                assert [t for t, _ in r.prompt_logprobs] == s.prompt[start:], why
        else:
            assert r.output_logprobs == [] and r.prompt_logprobs == []
        if p["max_new_tokens"] == 0:
            assert r.output_ids == []
            evicted = s.evicted_at_submit != self.eng.cache.evicted_blocks_total
            if r.finish_reason is FinishReason.LENGTH and not self.cut(s, r) and not evicted:
                assert s.cached_at_finish == len(s.prompt), (
                    "a prefill-only prompt not cached",
                    why,
                )
        if "regex" in p and r.finish_reason is FinishReason.STOP:
            assert re.fullmatch(p["regex"], r.text), (p["regex"], r.text)
        if r.finish_reason is FinishReason.STOP and isinstance(r.matched_stop, str):
            assert r.matched_stop in p["stop"]
        if p["temperature"] != 0 and "seed" not in p:
            return  # unseeded sampling: nothing to compare with
        want = self.alone(s.prompt, p)
        n = len(r.output_ids)
        cut = self.cut(s, r)
        if cut:
            assert r.output_ids == want.output_ids[:n], (want.output_ids, why)
        else:
            assert r.output_ids == want.output_ids, (want.output_ids, why)
            assert r.finish_reason is want.finish_reason
            assert r.text == want.text and r.matched_stop == want.matched_stop
        if p.get("return_logprob"):
            got, ref = r.output_logprobs, want.output_logprobs[:n]
            assert all(abs(a - b) < LOGPROB_TOL for a, b in zip(got, ref, strict=True))
            if not cut:
                pairs = zip(r.prompt_logprobs, want.prompt_logprobs, strict=True)
                for (t, a), (u, b) in pairs:
                    assert t == u and (a is None) == (b is None)
                    assert a is None or abs(a - b) < LOGPROB_TOL

    def stuck(self) -> list:
        sched = self.eng.scheduler
        return [
            (r.rid, r.status, r.prompt_len, len(r.tokens), r.num_computed, r.params)
            for r in sched.waiting + sched.running
        ] + [self.eng.pool.num_free, self.held]

    def teardown(self) -> None:
        eng = self.eng
        if eng is None:
            return
        try:
            self.eng.pool.decref(self.held)
            self.held = []
            live = [s for s in self.subs if not s.handle.done]
            for s in live[::3]:  # abort a third, let the others finish
                s.aborted = True
                s.handle.abort()
            for _ in range(5000):
                if not eng.step() and not eng.scheduler.has_work():
                    break
            assert all(s.handle.done for s in self.subs), f"never finished: {self.stuck()}"
            self.finished_requests_are_right()
            self.integrity()
            assert eng.flush_cache() is True
            assert eng.cache.cached_tokens == 0 and eng.cache.protected_size() == 0
            assert eng.pool.num_free == eng.pool.num_blocks, "KV blocks leaked"
            eng.pool.check_integrity({})
            if self.extra:  # what speculation did, over all programs (checked at the end)
                stats = eng.stats()
                for key in ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens"):
                    self.shared[key] = self.shared.get(key, 0) + stats[key]
        finally:
            eng.shutdown(free_cache=True)


def engine(folder, **kw) -> Engine:
    kw.setdefault("block_size", BLOCK)
    kw.setdefault("background", False)
    kw.setdefault("check_integrity_every_step", True)
    kw.setdefault("dtype", "float32")
    return Engine(folder, **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_stateful") / "llama"
    return make_tiny_llama_with_tokenizer(folder, max_position_embeddings=256)


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_engine_state_machine(folder, monkeypatch, speculative):
    tokenizers: dict = {}

    def shared_tokenizer(files):  # each engine would spend 0.5 s parsing the same files
        if files.path not in tokenizers:
            tokenizers[files.path] = load_tokenizer(files)
        return tokenizers[files.path]

    monkeypatch.setattr(engine_module, "_load_tokenizer", shared_tokenizer)
    shared: dict = {}
    try:
        run_state_machine_as_test(
            lambda: EngineMachine(folder, shared, speculative),
            settings=settings(
                max_examples=40 * SCALE,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )
    finally:
        for ref in shared.get("engines", {}).values():
            ref.shutdown()
    if speculative != "off":  # drafts were verified, and some rejected and some accepted
        assert shared["spec_verify_steps"] > 20, shared
        assert 0 < shared["spec_accepted_tokens"] < shared["spec_draft_tokens"], shared
