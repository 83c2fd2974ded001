"""Speculative decoding in the engine, on tiny random models: greedy outputs (with stops,
constraints, penalties, logprobs, streams) equal those without drafts, token for token; the
first tokens a sampled request draws after a draft have the model's distribution (a chi-square
test over 20,000 samples); drafts from the radix cache; overlapped scheduling; and every KV
block back in the pool.

The drafter's step cost is pinned (``stepped_engine``): the counts of drafts and steps asserted
here follow from the requests alone, not from the machine's speed.

Comparisons run in deterministic mode, where a token's logits are bitwise the same whether a
decode step or a verifying extend computes them (in the default mode they may differ in the
last bits, as they do between batches, and a near tie can go the other way)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PINNED_STEP_COST_MS, make_tiny_llama_with_tokenizer, make_tiny_model
from tiny_models import stepped_engine as engine

from radixlang.runtime.engine import Engine
from radixlang.runtime.speculative import acceptance

# A tiny random model's greedy text soon repeats itself: its own output drafts. The prompts
# repeat a phrase, so that drafts start early.
PHRASE = [911, 4021, 77, 3005, 612, 2048, 5120, 33]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama_with_tokenizer(
        tmp_path_factory.mktemp("spec_engine") / "llama", max_position_embeddings=1024
    )


def _requests() -> list[tuple[list[int], dict]]:
    base = PHRASE * 3
    return [
        (base, {"max_new_tokens": 40}),
        ([*base, 5], {"max_new_tokens": 33, "return_logprob": True, "top_logprobs_num": 3}),
        ([7, 8, *base], {"max_new_tokens": 40, "repetition_penalty": 1.3}),
        (base[:20], {"max_new_tokens": 30, "min_new_tokens": 12}),
        ([*base, 9, 9], {"max_new_tokens": 40, "regex": r"(ab|cd)[0-9]{3,9}( yes| no)+"}),
        (base, {"max_new_tokens": 40, "frequency_penalty": 0.4, "presence_penalty": 0.2}),
        (PHRASE[:3] * 7, {"max_new_tokens": 45, "ignore_eos": True}),
    ]


def _run(eng: Engine, requests, stop_texts=None):
    handles = []
    events: list[list] = []
    for i, (prompt, params) in enumerate(requests):
        p = {"temperature": 0, **params}
        if stop_texts is not None and stop_texts[i]:
            p["stop"] = [stop_texts[i]]
        log: list = []
        events.append(log)
        handles.append(eng.submit(prompt, p, on_event=log.append))
    while eng.step():
        pass
    return [h.result() for h in handles], events


def _same(a, b) -> None:
    assert a.output_ids == b.output_ids
    assert a.text == b.text
    assert a.finish_reason is b.finish_reason and a.matched_stop == b.matched_stop
    assert a.output_logprobs == b.output_logprobs
    assert a.output_top_logprobs == b.output_top_logprobs


def _drained(eng: Engine) -> None:
    eng.check_integrity()
    assert eng.flush_cache() is True
    assert eng.pool.num_free == eng.pool.num_blocks, "KV blocks leaked"


@pytest.mark.parametrize("overlap", [False, True], ids=["one_at_a_time", "overlap"])
def test_greedy_outputs_equal_those_without_drafts(folder, overlap):
    requests = _requests()
    plain = engine(folder, deterministic=True)
    want, _ = _run(plain, requests)
    # Stop strings cut from the middle of the outputs: a stop inside an accepted draft.
    stops = [r.text[10:14] if len(r.text) > 20 and i % 2 else None for i, r in enumerate(want)]
    want_stopped, _ = _run(plain, requests, stops)
    plain.shutdown()

    spec = engine(folder, deterministic=True, speculative="ngram", overlap=overlap)
    for expected, stop_texts in ((want, None), (want_stopped, stops)):
        got, events = _run(spec, requests, stop_texts)
        for a, b, stream in zip(got, expected, events, strict=True):
            _same(a, b)
            # The stream adds up to the result, one finished event at its end.
            assert [t for e in stream for t in e.token_ids] == a.output_ids
            assert "".join(e.text for e in stream) == a.text
            assert stream[-1].finished and not any(e.finished for e in stream[:-1])
    stats = spec.stats()
    assert stats["spec_verify_steps"] > 10
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["spec_tokens_per_verify"] > 1.5
    # Fewer steps than tokens: several tokens per step.
    assert stats["steps"] < stats["generated_tokens"]
    _drained(spec)
    spec.shutdown()


def test_default_mode_verifies_drafts_as_extends(folder, monkeypatch):
    """Outside deterministic mode (and without CUDA graphs) a step with drafts is one extend
    per drafting request, its KV read once for all the drafts (the native kernel's
    multi-query tiles on a CPU): float32 greedy outputs are those without drafts, logprobs
    within float rounding."""
    from radixlang.runtime.model_runner import ModelRunner

    requests = _requests()
    plain = engine(folder)
    want, _ = _run(plain, requests)
    plain.shutdown()
    spec = engine(folder, speculative="ngram")
    as_decodes = []
    real = ModelRunner._forward_as_decodes
    monkeypatch.setattr(
        ModelRunner,
        "_forward_as_decodes",
        lambda self, seqs: as_decodes.append(1) or real(self, seqs),
    )
    got, _ = _run(spec, requests)
    for a, b in zip(got, want, strict=True):
        assert a.output_ids == b.output_ids and a.text == b.text
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)
    stats = spec.stats()
    assert stats["spec_verify_steps"] > 10 and stats["spec_accepted_tokens"] > 0
    assert not as_decodes  # every verify step ran as extends
    _drained(spec)
    spec.shutdown()


def test_a_repeated_prompt_drafts_from_the_radix_cache(folder):
    eng = engine(folder, deterministic=True, speculative="ngram")
    prompt = [101, 202, 303, 404, 505, 606, 707]  # nothing in it repeats
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    first = eng.generate(prompt, params)
    eng.reset_stats()
    # Its path (prompt and output) is cached: the same prompt drafts the whole answer from it.
    again = eng.generate(prompt, params)
    assert again.output_ids == first.output_ids
    stats = eng.stats()
    assert stats["spec_accept_rate"] == 1.0
    assert stats["steps"] <= 10  # 40 tokens in a few steps, not 40
    _drained(eng)
    eng.shutdown()


def test_aborts_and_retractions_with_drafts_leak_nothing(folder):
    """Under memory pressure (a pool of 40 blocks of 4 tokens) with aborts mid-run: one prompt
    submitted every few steps, so that later requests trail earlier ones and draft from their
    text (and, once they end, from the radix cache)."""
    eng = engine(folder, deterministic=True, speculative="ngram", num_blocks=40)
    prompt = PHRASE * 2
    handles = []
    for step in range(600):
        if step % 4 == 0 and len(handles) < 8:
            params = {"temperature": 0, "max_new_tokens": 40 + 5 * len(handles)}
            handles.append(eng.submit(prompt, params | {"ignore_eos": True}))
        if step in (9, 17):
            handles[step // 8].abort()
        if not eng.step() and len(handles) == 8:
            break
    results = [h.result(raise_on_error=False) for h in handles]
    assert all(r.error is None for r in results)
    assert eng.scheduler.counters.retractions > 0  # the pool was short
    assert eng.stats()["spec_accepted_tokens"] > 50
    # Whole outputs agree with each other (one greedy answer, cut at different lengths).
    longest = max((r.output_ids for r in results), key=len)
    for r in results:
        assert r.output_ids == longest[: len(r.output_ids)]
    _drained(eng)
    eng.shutdown()


# ---- sampled requests: the distribution ------------------------------------------------------

SAMPLES_PER_ARM = 10_000  # 20,000 in all


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny random llama with 160 tokens (a histogram of its tokens has few bins)."""
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("spec_vocab") / "llama", max_position_embeddings=1024
    )


def _second_tokens(folder, speculative: str) -> tuple[torch.Tensor, dict]:
    """The second output token of many sampled requests whose prompt makes every first token
    draft: the prompt holds each token t followed by the marker, so the suffix [marker, t]
    always occurred, and the draft is the marker again."""
    marker = 7
    prompt = [x for t in range(160) for x in (marker, t)] + [marker]
    eng = Engine(
        folder,
        dtype="float32",
        background=False,
        speculative=speculative,
        speculative_step_cost_ms=PINNED_STEP_COST_MS,
        deterministic=True,
        max_running_requests=512,
    )
    # The marker likely enough that drafts are both accepted and rejected.
    params = {
        "temperature": 1.0,
        "max_new_tokens": 3,  # the first from the prompt; the second verifies a draft
        "ignore_eos": True,
        "logit_bias": {marker: 5.0},
    }
    handles = [eng.submit(prompt, params) for _ in range(SAMPLES_PER_ARM)]
    while eng.step():
        pass
    seconds = torch.tensor([h.result().output_ids[1] for h in handles])
    stats = eng.stats()
    _drained(eng)
    eng.shutdown()
    return torch.bincount(seconds, minlength=160).float(), stats


def _homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two histograms come from one distribution (bins with fewer than
    10 counts in all pooled)."""
    total = a + b
    small = total < 10
    a = torch.cat([a[~small], a[small].sum().reshape(1)])
    b = torch.cat([b[~small], b[small].sum().reshape(1)])
    table = torch.stack([a, b])
    keep = table.sum(0) > 0
    table = table[:, keep]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


@pytest.fixture(scope="module")
def without_drafts(small_vocab) -> torch.Tensor:
    return _second_tokens(small_vocab, "off")[0]


def test_sampled_tokens_after_a_draft_have_the_models_distribution(small_vocab, without_drafts):
    spec, stats = _second_tokens(small_vocab, "ngram")
    # Most requests verified a one-token draft at their only decode step (the cost rule may
    # decline some in a batch of 512).
    assert stats["spec_draft_tokens"] >= SAMPLES_PER_ARM * 0.8
    accepted = stats["spec_accepted_tokens"] / stats["spec_draft_tokens"]
    assert 0.05 < accepted < 0.95, accepted  # both branches of the rule ran, often
    assert _homogeneity_p(without_drafts, spec) > 1e-3


def test_the_engine_level_test_fails_a_wrong_rule(small_vocab, without_drafts, monkeypatch):
    """A rejected draft drawn again from the whole distribution (the draft token kept in):
    the test above then fails."""
    monkeypatch.setattr(acceptance, "residual_probs", lambda probs, drafts: probs)
    spec, _ = _second_tokens(small_vocab, "ngram")
    assert _homogeneity_p(without_drafts, spec) < 1e-6


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_drafts_on_the_torch_and_triton_kernels(small_vocab, monkeypatch, kernels):
    """The verification's rows are decodes on whichever kernels run them (Triton interpreted
    on a CPU: a short run, on 160 tokens, since deterministic mode's matmuls are Triton's
    there too and an interpreted LM head over 49,152 tokens took minutes)."""
    folder = small_vocab
    monkeypatch.setenv("RADIXLANG_KERNELS", kernels)
    prompt = [11, 42, 77, 130] * 3
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    plain = engine(folder, deterministic=True)
    want = plain.generate(prompt, params)
    plain.shutdown()
    spec = engine(folder, deterministic=True, speculative="ngram")
    first = spec.generate(prompt, params)
    again = spec.generate(prompt, params)  # drafted from the radix cache
    assert first.output_ids == want.output_ids == again.output_ids
    assert spec.stats()["spec_accepted_tokens"] >= 4  # the repeat, at least, drafts
    _drained(spec)
    spec.shutdown()


def test_beams_and_seeded_samples_do_not_draft(folder):
    """Beam search keeps its own search, and a seed its samples: neither drafts."""
    eng = engine(folder, speculative="ngram")
    prompt = PHRASE * 2
    beams = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 12, "beam_width": 3})
    seeded = [
        eng.generate(prompt, {"temperature": 1.0, "max_new_tokens": 12, "seed": 7})
        for _ in range(2)
    ]
    assert len(beams.beams) == 3
    assert seeded[0].output_ids == seeded[1].output_ids
    assert eng.stats()["spec_draft_tokens"] == 0
    plain = engine(folder)
    assert (
        plain.generate(prompt, {"temperature": 1.0, "max_new_tokens": 12, "seed": 7}).output_ids
        == seeded[0].output_ids
    )
    plain.shutdown()
    _drained(eng)
    eng.shutdown()
