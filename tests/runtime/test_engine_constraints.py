"""Constrained decoding in the engine: ``sampling.regex`` and ready ``GenerateRequest.constraint``
objects, on a tiny random llama that carries the default model's tokenizer (vocab 49152), so that
regexes meet real multi-character byte-level BPE tokens. Sampling at temperature 1.0 from random
weights wanders everywhere the masks allow, which is what these tests want."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_models import make_tiny_llama_with_tokenizer, make_tiny_model

from radixlang.constrain import GrammarConstraint, compile_grammar
from radixlang.model_files import DEFAULT_MODEL
from radixlang.runtime.constraint import TokenConstraint
from radixlang.runtime.engine import Engine, RequestError
from radixlang.runtime.handle import GenerationError
from radixlang.runtime.request import FinishReason, GenerateRequest
from radixlang.runtime.sampling_rows import SamplingRows

VOCAB = 49152


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_tok") / "llama"
    return make_tiny_llama_with_tokenizer(folder, max_position_embeddings=512)


@pytest.fixture(scope="module")
def eng(folder):
    e = engine(folder)
    yield e
    e.shutdown()


def engine(folder, **kw) -> Engine:
    """A stepped engine of the "auto" dtype, deterministic: some tests compare a request's
    outputs alone and beside constrained ones, cached and not, with jump-forward's extends and
    without, which in bfloat16 only the mode keeps bitwise equal."""
    kw.setdefault("deterministic", True)
    kw.setdefault("num_blocks", 512)
    kw.setdefault("block_size", 4)
    kw.setdefault("background", False)
    kw.setdefault("check_integrity_every_step", True)
    return Engine(folder, **kw)


def sampled(regex: str, seed: int, **kw) -> dict:
    return {"regex": regex, "temperature": 1.0, "seed": seed, "max_new_tokens": 48} | kw


def regex_constraint(eng: Engine, regex: str) -> GrammarConstraint:
    grammar = compile_grammar("regex", regex, eng.tokenizer, VOCAB, eng.eos_token_ids)
    return grammar.new_constraint()


def test_engine_loads_the_copied_tokenizer(eng):
    assert eng.tokenizer is not None and len(eng.tokenizer) == VOCAB
    assert eng.runner.vocab_size == VOCAB and 2 in eng.eos_token_ids


# Bounded regexes: every output must end in a full match (the automaton runs out of room or
# samples EOS well before max_new_tokens).
BOUNDED = [
    r"(yes|no)",
    r"(True|False)",
    r"[0-9]{1,6}",
    r'"[^"\n]{0,12}"',
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"(the|a) (cat|dog) (sat|ran)!",
]
# Open-ended: EOS competes with the digits in every accepting state, so nearly every run stops
# early; a run that reaches max_new_tokens must still be a prefix of a match.
OPEN = [r"[-+]?[0-9]+", r"[-+]?[0-9]*\.?[0-9]+"]


@pytest.mark.parametrize("regex", BOUNDED)
def test_every_output_fully_matches(eng, regex):
    prompts = ["Answer: ", "Q: what is it?\nA:", "x"] * 2
    params = [sampled(regex, seed) for seed in range(len(prompts))]
    results = eng.generate(prompts, params)
    for r in results:
        assert r.finish_reason is FinishReason.STOP, (regex, r.text)
        assert re.fullmatch(regex, r.text), (regex, r.text)
        assert r.output_ids and all(0 <= t < VOCAB for t in r.output_ids)
    eng.check_integrity()


@pytest.mark.parametrize("regex", OPEN)
def test_open_ended_regexes_end_where_the_model_leaves_them(eng, regex):
    n = 6
    handles = [eng.submit("Number: ", sampled(regex, seed)) for seed in range(n)]
    while not all(h.done for h in handles):
        eng.step()
    left = 0
    for h in handles:
        r = h.result()
        assert r.finish_reason is FinishReason.STOP, r.text
        assert re.fullmatch(regex, r.text), r.text
        if r.matched_stop is None:
            # The model chose a token that cannot extend the match: the value ends before
            # it, and that token is neither in the output nor in the stream.
            left += 1
            assert 2 not in r.output_ids
        else:
            assert r.output_ids[-1] == 2 and r.matched_stop == 2  # a sampled EOS
        assert "".join(e.text for e in h) == r.text
        assert h.saw_finish
    # Random weights put most mass outside the digits: most values end by leaving.
    assert left >= n // 2
    eng.check_integrity()


def test_dead_end_finishes_without_eos_and_streams_the_text(eng):
    handle = eng.submit("Answer: ", sampled(r"(yes|no)!", 3))
    while not handle.done:
        eng.step()
    r = handle.result()
    assert r.text in ("yes!", "no!") and r.finish_reason is FinishReason.STOP
    assert r.matched_stop is None  # ended by the constraint, not by EOS
    assert 2 not in r.output_ids
    assert "".join(e.text for e in handle) == r.text


def test_a_regex_of_the_empty_string_generates_nothing(eng):
    r = eng.generate("x", sampled("", 0))
    assert r.output_ids == [] and r.text == "" and r.finish_reason is FinishReason.STOP
    r = eng.generate("x", sampled("(abc)?", 0))
    assert r.text in ("", "abc") and r.finish_reason is FinishReason.STOP


@pytest.mark.compares_outputs
def test_greedy_and_mixed_batches(eng):
    plain = {"temperature": 1.0, "seed": 11, "max_new_tokens": 6, "ignore_eos": True}
    alone = eng.generate("Hello", plain)
    batch = eng.generate(
        ["Hello", "Hello", "Hi"],
        [plain, sampled(r"[0-9]{2,4}", 5), {"regex": r"(on|off)", "temperature": 0}],
    )
    assert batch[0].output_ids == alone.output_ids  # a constrained neighbour changes nothing
    assert re.fullmatch(r"[0-9]{2,4}", batch[1].text)
    assert batch[2].text in ("on", "off")


def test_min_and_max_new_tokens_still_apply(eng):
    # max_new_tokens cuts a match short (finish reason length).
    r = eng.generate("n: ", sampled(r"[0-9]{10}", 1, max_new_tokens=3))
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_ids) == 3
    assert re.fullmatch(r"[0-9]{3}", r.text)
    # min_new_tokens keeps EOS away while the regex may go on ...
    params = [sampled(r"[0-9]+", seed, min_new_tokens=5, max_new_tokens=12) for seed in range(4)]
    for r in eng.generate(["n: "] * 4, params):
        assert len(r.output_ids) >= 5 and re.fullmatch(r"[0-9]+", r.text)
    # ... but a complete match ends the request even before min_new_tokens.
    r = eng.generate("a: ", sampled(r"(yes|no)", 0, min_new_tokens=10))
    assert r.finish_reason is FinishReason.STOP and r.text in ("yes", "no")
    eng.check_integrity()


def test_bad_regex_is_a_request_error_and_the_engine_keeps_serving(eng):
    for bad, why in (("(ab", "invalid regex"), (r"(?=a)b", "look-around"), (5, "must be a str")):
        with pytest.raises(RequestError, match=why):
            eng.submit("x", {"regex": bad})
    both = GenerateRequest(
        text="x", sampling={"regex": "[0-9]+"}, constraint=regex_constraint(eng, "[0-9]+")
    )
    with pytest.raises(RequestError, match="not both"):
        eng.submit(both)
    with pytest.raises(RequestError, match="allowed_mask"):
        eng.submit(GenerateRequest(text="x", constraint=object()))  # type: ignore[arg-type]
    r = eng.generate("x", sampled(r"(ok)", 0))
    assert r.text == "ok"
    eng.check_integrity()


def test_regex_without_a_tokenizer_is_a_request_error(tmp_path):
    bare = engine(make_tiny_model("llama", tmp_path / "bare"), num_blocks=64)
    assert bare.tokenizer is None
    with pytest.raises(RequestError, match="tokenizer"):
        bare.submit([5, 6, 7], {"regex": "[0-9]+"})


class AllowList:
    """A caller's own constraint: a few ids, a mask narrower than the logits, n tokens."""

    def __init__(self, ids: list[int], n: int, width: int = 1000, fail_at: int = -1):
        self.mask = torch.zeros(width, dtype=torch.bool)
        self.mask[ids] = True
        self.n, self.taken, self.fail_at = n, [], fail_at

    def allowed_mask(self) -> torch.Tensor:
        return self.mask

    def advance(self, token_id: int) -> None:
        if len(self.taken) == self.fail_at:
            raise RuntimeError("injected constraint fault")
        assert self.mask[token_id]
        self.taken.append(token_id)

    def is_finished(self) -> bool:
        return len(self.taken) >= self.n


def test_a_callers_own_constraint(eng):
    c = AllowList([300, 301, 302], n=4)
    assert isinstance(c, TokenConstraint)
    r = eng.submit(GenerateRequest(input_ids=[5, 6, 7], constraint=c, sampling={"seed": 1}))
    while not r.done:
        eng.step()
    res = r.result()
    assert res.output_ids == c.taken and len(c.taken) == 4
    assert set(c.taken) <= {300, 301, 302}
    assert res.finish_reason is FinishReason.STOP and res.matched_stop is None
    eng.check_integrity()


def test_a_failing_constraint_fails_only_its_request(eng):
    bad = eng.submit(
        GenerateRequest(input_ids=[5, 6, 7], constraint=AllowList([300, 301], 5, fail_at=2))
    )
    empty = eng.submit(GenerateRequest(input_ids=[5, 6, 8], constraint=AllowList([], 5)))
    good = eng.submit([5, 6, 9], {"max_new_tokens": 5, "ignore_eos": True})
    while not (bad.done and empty.done and good.done):
        eng.step()
    with pytest.raises(GenerationError, match="injected constraint fault"):
        bad.result()
    assert len(bad.result(raise_on_error=False).output_ids) == 3
    with pytest.raises(GenerationError, match="allows no token"):
        empty.result()
    assert good.result().completion_tokens == 5
    eng.check_integrity()


class Counting:
    """Wraps a constraint and counts its advances."""

    def __init__(self, inner: GrammarConstraint):
        self.inner, self.advances = inner, 0

    def allowed_mask(self) -> torch.Tensor:
        return self.inner.allowed_mask()

    def advance(self, token_id: int) -> None:
        self.advances += 1
        self.inner.advance(token_id)

    def is_finished(self) -> bool:
        return self.inner.is_finished()


def test_retraction_does_not_advance_the_constraint_again(folder):
    # A pool far too small for the batch: requests are retracted and re-run from the cache;
    # the re-run recomputes their tokens without sampling them, so no advance is repeated.
    # Digits are single tokens, so each request takes exactly 20 tokens: twice what the
    # scheduler's reserve expects at first, which is what makes it retract.
    small = engine(folder, num_blocks=40)
    regex = r"[0-9]{20}"
    prompt = small.tokenizer.encode("Write a long number, please: ")
    constraints, handles = [], []
    for seed in range(8):
        c = Counting(regex_constraint(small, regex))
        constraints.append(c)
        request = GenerateRequest(
            input_ids=[*prompt, 100 + seed],
            sampling={"temperature": 1.0, "seed": seed, "max_new_tokens": 20},
            constraint=c,
        )
        handles.append(small.submit(request))
    while not all(h.done for h in handles):
        small.step()
    assert small.stats()["retractions"] > 0  # the pressure did happen
    for c, h in zip(constraints, handles, strict=True):
        r = h.result()
        assert c.advances == len(r.output_ids)
        assert r.finish_reason is FinishReason.STOP and re.fullmatch(regex, r.text), r.text
    small.check_integrity()
    assert small.flush_cache() and small.pool.num_free == small.pool.num_blocks


def test_no_mask_work_without_constraints(eng, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("constrained path taken with no constraint in the batch")

    monkeypatch.setattr(SamplingRows, "constrained", boom)
    r = eng.generate(["a", "b"], {"max_new_tokens": 3, "ignore_eos": True})
    assert [x.completion_tokens for x in r] == [3, 3]


# ---- the real default model --------------------------------------------------------------------
@pytest.mark.slow
def test_default_model_answers_in_digits():
    with Engine(DEFAULT_MODEL, kv_memory="256MiB") as real:
        chat = [{"role": "user", "content": "How many legs does a spider have?"}]
        prompt = real.tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
        for params in (
            {"regex": r"[0-9]+", "temperature": 0, "max_new_tokens": 8},
            {"regex": r"[0-9]+", "temperature": 1.0, "seed": 0, "max_new_tokens": 8},
        ):
            r = real.generate(prompt, params)
            assert re.fullmatch(r"[0-9]+", r.text), r.text
        real.check_integrity()


# ---- jump-forward and token healing ------------------------------------------------------------
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_full_legal_name": {"type": "string", "maxLength": 6},
        "invoice_status_code": {"enum": ["paid_in_full", "overdue_and_unpaid"]},
    },
    "required": ["customer_full_legal_name", "invoice_status_code"],
}


@pytest.mark.compares_outputs
def test_jump_forward_gives_the_same_text_in_fewer_steps(folder):
    outputs, steps, stats = {}, {}, {}
    for jump in (False, True):
        e = engine(folder, jump_forward=jump)
        params = [{"json_schema": LONG_KEYS, "temperature": 0, "max_new_tokens": 64}] * 3
        before = e.stats()["steps"]
        results = e.generate(["Invoice one:", "Invoice two:", "Invoice three:"], params)
        steps[jump] = e.stats()["steps"] - before
        stats[jump] = e.stats()
        outputs[jump] = [r.text for r in results]
        for r in results:
            assert r.finish_reason is FinishReason.STOP
            assert json.loads(r.text).keys() == LONG_KEYS["properties"].keys()
        e.check_integrity()
        assert e.flush_cache() and e.pool.num_free == e.pool.num_blocks
    assert outputs[True] == outputs[False]
    assert stats[False]["jump_forward_tokens"] == 0
    assert stats[True]["jump_forward_tokens"] >= 10 and stats[True]["jump_forward_jumps"] >= 2
    assert steps[True] < steps[False]
    assert stats[True]["grammar_mask_steps"] > 0 and stats[True]["grammar_mask_ms_p99"] > 0


def test_jump_forward_respects_max_new_tokens_and_logprob_requests(eng):
    r = eng.generate("x", {"json_schema": LONG_KEYS, "temperature": 0, "max_new_tokens": 4})
    assert r.completion_tokens == 4 and r.finish_reason is FinishReason.LENGTH
    before = eng.stats()["jump_forward_tokens"]
    r = eng.generate("x", {"json_schema": LONG_KEYS, "max_new_tokens": 64, "return_logprob": True})
    assert eng.stats()["jump_forward_tokens"] == before  # every token decoded, with a logprob
    assert len(r.output_logprobs) == r.completion_tokens and None not in r.output_logprobs
    eng.check_integrity()


def test_token_healing_backs_up_a_cut_off_token(eng):
    tok = eng.tokenizer
    prompt = "Visit http:"
    ids = tok.encode(prompt)
    removed = tok.decode(ids[-1:])
    for seed in range(4):
        r = eng.generate(prompt, {"token_healing": True, "temperature": 1.0, "seed": seed,
                                  "max_new_tokens": 4, "ignore_eos": True})  # fmt: skip
        assert r.prompt_tokens == len(ids) - 1
        first = tok.decode(r.output_ids[:1])
        assert first.startswith(removed) and first != "" and r.completion_tokens == 5
        assert removed + r.text == tok.decode(r.output_ids)
    eng.check_integrity()


def test_token_healing_keeps_its_first_mask_beside_constrained_rows(eng):
    # One batch: a healed free-text request and a regex request. The constrained row makes the
    # engine build every row's mask per request; the healed row must still get its first mask.
    tok = eng.tokenizer
    prompt = "Visit http:"
    ids = tok.encode(prompt)
    removed = tok.decode(ids[-1:])
    for seed in range(4):
        healed, constrained = eng.generate(
            [prompt, "Code:"],
            [
                {"token_healing": True, "temperature": 1.0, "seed": seed, "max_new_tokens": 4,
                 "ignore_eos": True},
                sampled("[a-z]{2,6}", seed),
            ],
        )  # fmt: skip
        assert healed.prompt_tokens == len(ids) - 1
        assert tok.decode(healed.output_ids[:1]).startswith(removed)
        assert removed + healed.text == tok.decode(healed.output_ids)
        assert re.fullmatch("[a-z]{2,6}", constrained.text)
    eng.check_integrity()


@pytest.mark.compares_outputs
def test_token_healing_changes_nothing_on_a_clean_boundary(eng):
    from radixlang.constrain import token_vocabulary

    vocab = token_vocabulary(eng.tokenizer, VOCAB)
    clean = next(
        t for t in range(1000, VOCAB) if vocab.text[t] and vocab.extending(vocab.text[t]) is None
    )
    prompt_ids = [*eng.tokenizer.encode("Hello"), clean]
    prompt = eng.tokenizer.decode(prompt_ids)
    assert eng.tokenizer.encode(prompt)[-1] == clean
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    plain = eng.generate(prompt, params)
    healed = eng.generate(prompt, params | {"token_healing": True})
    assert healed.output_ids == plain.output_ids and healed.text == plain.text
    assert healed.prompt_tokens == plain.prompt_tokens
    # With a constraint the prompt is left whole (healing applies to free text only).
    r = eng.generate("Visit http:", {"token_healing": True, "regex": "[a-z]{1,3}"})
    assert r.prompt_tokens == len(eng.tokenizer.encode("Visit http:"))


# ---- masks filled beside the forward -----------------------------------------------------------
@pytest.mark.compares_outputs
def test_masks_filled_beside_the_forward_give_the_same_outputs(folder):
    # A mixed batch: JSON schema and regex rows (grammar masks), seeded sampling and greedy,
    # jump-forward on; the masks filled on the worker during the forward must be exactly the
    # ones filled after it.
    params = [
        {"json_schema": LONG_KEYS, "temperature": 1.0, "seed": 3, "max_new_tokens": 48},
        {"regex": r"[a-z]{3,9}( [a-z]{2,5}){1,3}", "temperature": 1.0, "seed": 4},
        {"json_schema": LONG_KEYS, "temperature": 0, "max_new_tokens": 48},
        {"max_new_tokens": 6, "ignore_eos": True},
    ]
    outputs, stats = {}, {}
    for overlap in (False, True):
        e = engine(folder, overlap_masks=overlap)
        results = e.generate(["one:", "two:", "three:", "four:"], params)
        outputs[overlap] = [(r.text, r.finish_reason) for r in results]
        stats[overlap] = e.stats()
        e.check_integrity()
        e.shutdown()
    assert outputs[True] == outputs[False]
    for overlap in (False, True):
        s = stats[overlap]
        assert s["grammar_mask_steps"] > 0 and s["grammar_mask_ms_p50"] > 0
    # Inline, a step waits for every fill it makes (one class here: one fill per step).
    inline = stats[False]
    assert inline["grammar_mask_wait_ms_p50"] >= inline["grammar_mask_ms_p50"]
    assert inline["grammar_mask_wait_ms_p99"] >= inline["grammar_mask_ms_p99"]


def test_a_constraint_failing_on_the_mask_worker_fails_only_its_request(folder):
    e = engine(folder, overlap_masks=True)
    good = e.submit("a:", {"json_schema": LONG_KEYS, "temperature": 0, "max_new_tokens": 48})
    bad = e.submit("b:", {"regex": r"[0-9]{4}", "temperature": 0, "max_new_tokens": 8})
    e.step()  # admitted and prefilled: the constraints exist now
    bad_req = e._reqs[bad.request_id]

    def broken(self):  # the batched fill raises for this request's matcher only
        raise RuntimeError("injected mask fault")

    bad_req.constraint._raise_if_error = broken.__get__(bad_req.constraint)
    while not (good.done and bad.done):
        e.step()
    with pytest.raises(GenerationError, match="injected mask fault"):
        bad.result()
    assert json.loads(good.result().text).keys() == LONG_KEYS["properties"].keys()
    e.check_integrity()
    e.shutdown()
    assert e.flush_cache() and e.pool.num_free == e.pool.num_blocks
