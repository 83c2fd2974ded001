"""Beam search on a tiny random llama: the same beams as transformers' ``generate(num_beams=k,
do_sample=False)``, beams sharing their KV blocks (copied only where they diverge), nothing
leaked, and the same result beside other requests as alone."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import load_reference, make_tiny_model, stepped_engine

from radixlang.runtime.engine import Engine, RequestError
from radixlang.runtime.radix_cache import common_prefix_len
from radixlang.runtime.request import FinishReason
from radixlang.runtime.sampling import SamplingParams, SamplingParamsError

VOCAB = 160
EOS = 2
# Stop ids that the random model picks often enough for beams to finish before the limit
# (exercising finished hypotheses and transformers' early-stop rule).
STOPS = [12, 36, 137, 56, 64, 79, 0, 123]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def reference(folder):
    return load_reference(folder)


def engine(folder, **kw) -> Engine:
    kw.setdefault("num_blocks", 128)
    return stepped_engine(folder, **kw)


def beam_params(width: int, max_new: int, **kw) -> dict:
    return {"temperature": 0, "beam_width": width, "max_new_tokens": max_new, **kw}


def reference_beams(model, prompt: list[int], params: dict) -> tuple[list[int], float]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=params["beam_width"],
            do_sample=False,
            max_new_tokens=params["max_new_tokens"],
            min_new_tokens=params.get("min_new_tokens", 0),
            length_penalty=params.get("length_penalty", 1.0),
            early_stopping=params.get("early_stopping", False),
            eos_token_id=[EOS, *params.get("stop_token_ids", [])],
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), float(out.sequences_scores[0])


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 15))] for _ in range(n)]


def no_leak(eng: Engine) -> None:
    eng.check_integrity()
    assert eng.cache.protected_size() == 0
    assert eng.flush_cache()
    assert eng.pool.num_free == eng.pool.num_blocks


CASES = [  # (width, length_penalty, early_stopping, stop ids, max_new_tokens)
    (2, 1.0, False, [], 10),
    (3, 1.0, False, STOPS[:3], 12),
    (4, 1.0, False, STOPS, 12),
    (2, 0.5, False, STOPS, 12),
    (3, 2.0, False, STOPS[:4], 12),
    (4, -1.0, False, STOPS[:2], 10),
    (3, 1.0, True, STOPS, 12),
    (4, 0.0, True, STOPS[:4], 8),
]


@pytest.mark.parametrize("width,penalty,early,stops,max_new", CASES)
def test_beams_equal_transformers(folder, reference, width, penalty, early, stops, max_new):
    eng = engine(folder)
    params = beam_params(
        width, max_new, length_penalty=penalty, early_stopping=early, stop_token_ids=stops
    )
    for prompt in prompts(4, seed=width * 100 + len(stops) + max_new):
        got = eng.generate(prompt, params)
        want_ids, want_score = reference_beams(reference, prompt, params)
        assert got.output_ids == want_ids
        assert got.beams[0].output_ids == got.output_ids
        assert got.beams[0].score == pytest.approx(want_score, abs=1e-3)
        assert len(got.beams) == width
        assert [b.score for b in got.beams] == sorted((b.score for b in got.beams), reverse=True)
        ended = got.output_ids[-1] in {EOS, *stops}
        assert got.finish_reason is (FinishReason.STOP if ended else FinishReason.LENGTH)
    no_leak(eng)


def test_searches_that_stop_early_still_match(folder, reference):
    """Many stop ids: hypotheses fill up quickly and the search ends on transformers' rule
    (no running beam can beat the worst finished one) well before the token limit."""
    eng = engine(folder)
    stops = list(range(3, VOCAB, 4))
    params = beam_params(3, 30, stop_token_ids=stops)
    for prompt in prompts(6, seed=7):
        got = eng.generate(prompt, params)
        assert got.output_ids == reference_beams(reference, prompt, params)[0]
    assert eng.stats()["generated_tokens"] < 6 * 3 * 30  # the searches ended early
    no_leak(eng)


def test_min_new_tokens_matches_transformers(folder, reference):
    eng = engine(folder)
    params = beam_params(3, 12, stop_token_ids=list(range(3, VOCAB, 4)), min_new_tokens=4)
    for prompt in prompts(4, seed=21):
        got = eng.generate(prompt, params)
        assert len(got.output_ids) >= 4
        assert got.output_ids == reference_beams(reference, prompt, params)[0]
    no_leak(eng)


def test_beams_share_blocks_and_copy_only_where_they_diverge(folder):
    eng = engine(folder, block_size=4)
    width = 4
    prompt = prompts(1, seed=3)[0] + list(range(20, 33))  # several full prompt blocks
    handle = eng.submit(prompt, beam_params(width, 20))
    peak_distinct = peak_private = 0
    while not handle.done:
        eng.step()
        beams = [r for r in eng.scheduler.running if r.beam is not None]
        if len(beams) < width:
            continue
        distinct = len({b for r in beams for b in r.blocks})
        private = sum(len(r.blocks) for r in beams)
        peak_distinct, peak_private = max(peak_distinct, distinct), max(peak_private, private)
        assert distinct < private
        for i, a in enumerate(beams):
            for b in beams[i + 1 :]:
                common = common_prefix_len(a.tokens, b.tokens)
                for j in range(min(len(a.blocks), len(b.blocks))):
                    # A block wholly inside the shared prefix is one block; from the one where
                    # the beams diverge on, each has its own.
                    assert (a.blocks[j] == b.blocks[j]) == (j < common // 4), (j, common)
    assert handle.result().output_ids
    # The prompt's blocks alone are shared by all four beams.
    assert peak_distinct <= peak_private - (width - 1) * (len(prompt) // 4)
    no_leak(eng)


def test_beam_request_beside_other_requests_equals_alone(folder):
    eng = engine(folder)
    rng = random.Random(5)
    beam_prompts = prompts(3, seed=11)
    params = [beam_params(w, 12, stop_token_ids=STOPS[:3]) for w in (2, 3, 4)]
    alone = [eng.generate(p, s) for p, s in zip(beam_prompts, params, strict=True)]
    no_leak(eng)
    handles = []
    for p, s in zip(beam_prompts, params, strict=True):
        # Neighbours: greedy and sampled requests, some sharing the beam prompt's prefix.
        for _ in range(2):
            other = [*p[: rng.randrange(1, len(p) + 1)], rng.randrange(3, VOCAB)]
            handles.append(eng.submit(other, {"temperature": 0.7, "seed": 1, "max_new_tokens": 9}))
        handles.append(eng.submit(p, s))
        eng.step()
    handles.append(eng.submit(beam_prompts[0], params[0]))  # the same beam search again
    while not all(h.done for h in handles):
        eng.step()
    beams = [h.result() for h in handles if h.result().beams]
    assert [r.output_ids for r in beams] == [r.output_ids for r in alone] + [alone[0].output_ids]
    for batched, single in zip(
        beams, alone, strict=False
    ):  # the same up to the batch's float rounding
        assert [b.output_ids for b in batched.beams] == [b.output_ids for b in single.beams]
        assert [b.score for b in batched.beams] == pytest.approx([b.score for b in single.beams])
    no_leak(eng)


def test_logprobs_add_up_to_the_score(folder):
    eng = engine(folder)
    params = beam_params(3, 8, length_penalty=0.7, return_logprob=True, top_logprobs_num=2)
    got = eng.generate(prompts(1, seed=2)[0], params)
    assert len(got.output_logprobs) == len(got.output_ids) == len(got.output_top_logprobs)
    total = sum(got.output_logprobs)
    assert got.beams[0].score == pytest.approx(total / len(got.output_ids) ** 0.7, abs=1e-4)
    for top, lp in zip(got.output_top_logprobs, got.output_logprobs, strict=True):
        assert len(top) == 2 and top[0][1] >= lp
    no_leak(eng)


def test_stream_ends_with_the_best_beam(folder):
    eng = engine(folder, background=True)
    try:
        handle = eng.submit(prompts(1, seed=4)[0], beam_params(2, 6))
        events = list(handle)
        result = handle.result()
        assert events[-1].finished
        assert [t for e in events for t in e.token_ids] == result.output_ids
        assert result.meta_info["beams"][0]["output_ids"] == result.output_ids
    finally:
        eng.shutdown(free_cache=True)


def test_abort_frees_every_beam(folder):
    eng = engine(folder)
    handle = eng.submit(prompts(1, seed=6)[0], beam_params(4, 40), request_id="b")
    for _ in range(5):
        eng.step()
    assert sum(r.beam is not None for r in eng.scheduler.running) == 4
    eng.abort("b")
    eng.step()
    assert handle.result(raise_on_error=False).finish_reason is FinishReason.ABORT
    assert not eng.scheduler.running
    no_leak(eng)


def test_memory_pressure_restarts_the_search_and_finds_the_same_beams(folder):
    """A pool too small for every request at once: the scheduler retracts requests, beams
    last; a search that loses a beam starts over and finds the same beams as alone."""
    beam_prompts = prompts(3, seed=9)
    params = beam_params(3, 24)
    alone = [engine(folder).generate(p, params) for p in beam_prompts]
    eng = engine(folder, num_blocks=24)
    handles = [eng.submit(p, params) for p in beam_prompts]
    handles += [eng.submit(p, {"temperature": 0, "max_new_tokens": 30}) for p in prompts(2, 10)]
    eng.step()
    groups = [eng._reqs[h.request_id].beam for h in handles[:3]]
    while not all(h.done for h in handles):
        eng.step()
    assert eng.stats()["retractions"] > 0 and sum(g.restarts for g in groups) > 0
    assert [h.result().output_ids for h in handles[:3]] == [r.output_ids for r in alone]
    no_leak(eng)


def test_a_search_alone_that_outgrows_the_pool_ends_with_its_best_beam_so_far(folder):
    eng = engine(folder, num_blocks=12)
    got = eng.generate(prompts(1, seed=9)[0], beam_params(4, 40))
    assert got.finish_reason is FinishReason.LENGTH
    assert 0 < len(got.output_ids) < 40
    assert got.beams[0].output_ids == got.output_ids
    no_leak(eng)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"beam_width": 0}, "beam_width must be >= 1"),
        ({"beam_width": 2.5}, "beam_width must be an int"),
        ({"beam_width": 2, "temperature": 0.7}, "temperature must be 0"),
        ({"beam_width": 2}, "temperature must be 0"),  # temperature's default is 1.0
        (
            {"beam_width": 2, "temperature": 0, "regex": "a+"},
            "regex: not supported with beam search",
        ),
        ({"beam_width": 2, "temperature": 0, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"beam_width": 2, "temperature": 0, "logit_bias": {"5": 1}}, "logit_bias"),
        ({"length_penalty": float("nan")}, "length_penalty must be finite"),
        ({"early_stopping": "never"}, "early_stopping must be a bool"),
    ],
)
def test_bad_beam_parameters_are_refused(kw, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kw)


def test_engine_refuses_beam_requests_it_cannot_run(folder):
    eng = engine(folder)
    with pytest.raises(RequestError, match="temperature must be 0"):
        eng.submit([5, 6, 7], {"beam_width": 3})
    with pytest.raises(RequestError, match="candidates per step"):
        eng.submit([5, 6, 7], beam_params(41, 4, stop_token_ids=[3, 4, 5]))  # 4 * 41 > 160
    assert SamplingParams(beam_width=1).beam_width == 1  # off: any temperature


def test_stop_strings_end_beams(chat_model_dir):
    """A beam whose text reaches a stop string ends there, its text cut before it."""
    eng = engine(chat_model_dir, num_blocks=256)
    prompt = "Once upon a time"
    plain = eng.generate(prompt, beam_params(3, 12))
    stop = plain.text[len(plain.text) // 2 :][:3]
    assert stop.strip()
    got = eng.generate(prompt, beam_params(3, 12, stop=[stop]))
    assert all(stop not in b.text for b in got.beams)
    assert any(b.finish_reason is FinishReason.STOP for b in got.beams)
    if got.finish_reason is FinishReason.STOP and got.output_ids[-1] not in eng.eos_token_ids:
        assert got.matched_stop == stop
    no_leak(eng)
