"""Speculative decoding's parts on their own: the n-gram index, the radix cache's
continuation, the step cost fit, the drafts' cost rule, and the acceptance rule's output
distribution (a chi-square test over 20,000 draws on a tiny model's logits, which fails for
two deliberately wrong rules)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_model

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.model_runner import ModelRunner, SequenceInput
from radixlang.runtime.radix_cache import RadixCache
from radixlang.runtime.sampling import SamplingParams, SamplingRow, target_probs
from radixlang.runtime.speculative import acceptance
from radixlang.runtime.speculative.acceptance import NO_DRAFT, sample_with_drafts
from radixlang.runtime.speculative.drafter import KIND_NAMES, Drafter, DraftState
from radixlang.runtime.speculative.ngram_index import NgramIndex
from radixlang.runtime.speculative.step_cost import StepCost

# ---- the n-gram index ----------------------------------------------------------------------


def test_ngram_index_finds_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 4, 9, 2, 3, 4, 5, 7, 2, 3, 4]
    index = NgramIndex(tokens)
    index.update()
    # [2, 3, 4] occurred twice before the suffix; the latest (followed by 5) wins, and its
    # longest match is 3 tokens ([9|7, 2, 3, 4] never occurred).
    n, at = index.find(tokens)
    assert (n, tokens[at]) == (3, 5)
    assert index.continuation(at, 4) == [5, 7, 2, 3]
    # The suffix never finds itself: a sequence with no repeat has no match.
    fresh = NgramIndex([1, 2, 3, 4])
    fresh.update()
    assert fresh.find([1, 2, 3, 4]) == (0, -1)


def test_ngram_index_updates_lazily_as_the_sequence_grows():
    tokens = [5, 6, 7]
    index = NgramIndex(tokens)
    index.update()
    assert index.find(tokens) == (0, -1)
    tokens += [8, 5, 6]  # the list grows; the index catches up at the next update
    index.update()
    n, at = index.find(tokens)
    assert n == 2 and index.continuation(at, 10) == [7, 8, 5, 6]
    tokens.append(-1)  # a placeholder (a token still being sampled) ends what is indexed
    index.update()
    assert index.continuation(at, 10) == [7, 8, 5, 6]


def test_ngram_index_falls_back_to_one_token():
    tokens = [4, 1, 4, 2, 6, 2, 4]
    index = NgramIndex(tokens)
    index.update()
    # No two-token suffix recurs ([2, 4] never occurred before); [4] alone did, latest at 2.
    n, at = index.find(tokens)
    assert (n, at) == (1, 3) and index.continuation(at, 3) == [2, 6, 2]


# ---- the radix cache's continuation ----------------------------------------------------------


def test_radix_continuation_follows_the_cached_path_after_exactly_these_tokens():
    pool = BlockPool(64, 4)
    cache = RadixCache(pool)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    second = [1, 2, 3, 4, 5, 6, 20, 21]
    for tokens in (first, second):
        blocks = pool.alloc(-(-len(tokens) // 4))
        cache.insert(tokens, blocks)
        pool.decref(blocks)
    match = cache.match_prefix([1, 2, 3])
    # From the handle on [1, 2, 3]: the path goes on; [4, 5, 6] then branches, the most
    # recently used branch (the second insert) first.
    assert cache.continuation(match.handle, [4, 5], 10) == [6, 20, 21]
    assert cache.continuation(match.handle, [4, 5, 6, 7], 10) == [8, 9]
    assert cache.continuation(match.handle, [4, 5, 6, 7], 1) == [8]
    assert cache.continuation(match.handle, [4, 9], 10) == []  # not cached after these
    assert cache.continuation(match.handle, [4, 5, 6, 7, 8, 9], 10) == []  # nothing after
    cache.match_prefix(first)  # touching the first path makes it the recent branch
    assert cache.continuation(match.handle, [4, 5], 10) == [6, 7, 8, 9]
    assert cache.evict(64) and cache.continuation(match.handle, [4], 10) == []


# ---- the step cost -------------------------------------------------------------------------


def test_step_cost_learns_a_device_from_its_steps():
    cost = StepCost(prior=(0.02, 0.001, 0.001))
    truth = (0.010, 0.002, 0.0003)
    for seqs in (1, 2, 4, 8, 16, 32) * 4:  # a few seconds of steps
        for tokens_per_seq in (1, 2, 5, 9):
            tokens = seqs * tokens_per_seq
            cost.observe(seqs, tokens, truth[0] + truth[1] * seqs + truth[2] * tokens)
    assert cost.per_token == pytest.approx(truth[2], rel=0.05)
    assert cost.seconds(8, 40) == pytest.approx(truth[0] + truth[1] * 8 + truth[2] * 40, rel=0.05)


def test_step_cost_learns_through_noise_and_forgets_an_old_regime():
    """Observations with noise (as a loaded machine gives) still find the per-token cost, and
    when the device's costs change (a neighbour took a core) the fit follows the recent steps."""
    rng = np.random.default_rng(0)
    cost = StepCost(prior=(0.02, 0.001, 0.001))

    def run(truth: tuple[float, float, float], rounds: int) -> None:
        for _ in range(rounds):
            for seqs in (1, 2, 4, 8, 16, 32):
                for tokens_per_seq in (1, 2, 5, 9):
                    tokens = seqs * tokens_per_seq
                    exact = truth[0] + truth[1] * seqs + truth[2] * tokens
                    cost.observe(seqs, tokens, exact * rng.uniform(0.9, 1.1))

    run((0.010, 0.002, 0.0003), 4)
    assert cost.per_token == pytest.approx(0.0003, rel=0.2)
    run((0.030, 0.004, 0.0009), 20)  # three times slower: the old steps have faded
    assert cost.per_token == pytest.approx(0.0009, rel=0.2)
    assert cost.seconds(8, 40) == pytest.approx(0.030 + 0.004 * 8 + 0.0009 * 40, rel=0.1)


def test_step_cost_never_goes_free_or_negative():
    cost = StepCost(prior=(0.02, 0.001, 0.001))
    for _ in range(50):  # steps whose time does not grow with tokens, or even shrinks
        for tokens in (1, 8, 32):
            cost.observe(4, tokens, 0.02 - 0.0001 * tokens)
    assert cost.per_token >= 0.05 * 0.001 > 0


def test_a_pinned_step_cost_keeps_its_prior_whatever_it_observes():
    cost = StepCost(prior=(0.019, 0.001, 0.0004), learn=False)
    for seqs in (1, 8, 32):
        cost.observe(seqs, 4 * seqs, 5.0)  # a machine 100x slower: ignored
    assert cost.per_token == 0.0004 and cost.seconds(2, 3) == pytest.approx(0.0222)
    assert cost.observed == 0


def test_the_engine_pins_its_step_cost_when_told(tmp_path):
    from tiny_models import make_tiny_model

    from radixlang.runtime.engine import Engine

    folder = make_tiny_model("llama", tmp_path / "llama")
    pinned = Engine(
        folder, background=False, num_blocks=16, dtype="float32", speculative="ngram",
        speculative_step_cost_ms=(10, 2, 0.5),
    )  # fmt: skip
    assert not pinned.drafter.cost.learn
    assert pinned.drafter.cost.seconds(1, 1) == pytest.approx(0.0125)
    learnt = Engine(folder, background=False, num_blocks=16, dtype="float32", speculative="ngram")
    assert learnt.drafter.cost.learn
    with pytest.raises(ValueError, match="speculative_step_cost_ms must be three milliseconds"):
        Engine(folder, background=False, speculative="ngram", speculative_step_cost_ms=(1, 2))
    pinned.shutdown()
    learnt.shutdown()


# ---- the drafts' cost rule -------------------------------------------------------------------


class _Req(SimpleNamespace):
    __hash__ = object.__hash__  # a dict key by identity, as a Req is


def _decoding(
    tokens: list[int], rid: int, acceptance: float, num_output: int = 1, ignore_eos=False
):
    """A stand-in for a decoding request whose own text drafts (``acceptance`` its estimate)."""
    req = _Req(
        beam=None,
        num_output=num_output,
        tokens=tokens,
        output_limit=100,
        generator=None,
        params=SamplingParams(temperature=0, ignore_eos=ignore_eos),
        handle=None,
        cache_salt="",
        rid=rid,
    )
    state = req.drafting = DraftState(NgramIndex(tokens))
    state.accepted = [1000 * acceptance] * len(KIND_NAMES)  # every kind of draft alike
    state.tried = [1000.0] * len(KIND_NAMES)
    return req


@pytest.mark.parametrize(
    ("batch", "acceptance", "drafted"),
    [
        (1, 0.3, True),  # alone, even a poor draft pays: verifying it is nearly free
        (32, 0.15, False),  # in a large batch a poor one does not
        (32, 0.95, True),  # a confident one still does
    ],
)
def test_the_cost_rule_drafts_what_pays(batch, acceptance, drafted):
    drafter = Drafter(RadixCache(BlockPool(8, 4)), StepCost(), max_draft=8)
    pattern = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    reqs = [_decoding([*pattern, 3, 4], i, acceptance) for i in range(batch)]
    plan = drafter.plan(reqs, budget=10_000, closed=False)
    assert bool(plan) is drafted
    for draft in plan.values():
        assert draft == pattern[2 : 2 + len(draft)]
    if drafted and acceptance > 0.9:
        assert max(map(len, plan.values())) >= 4  # confident: several tokens


def test_a_batch_that_runs_to_its_length_limit_drafts_only_where_a_step_is_saved():
    """Forked samples that ignore EOS end together: a request ahead of the others gains
    nothing from drafts; of several furthest behind, each needs all the others to take a
    token too, so unsure ones do not draft at all."""
    drafter = Drafter(RadixCache(BlockPool(8, 4)), StepCost(), max_draft=8)
    tokens = [3, 4, 5, 6, 7, 8, 3, 4]
    tied = [_decoding(list(tokens), i, 0.5, num_output=10, ignore_eos=True) for i in range(8)]
    assert drafter.plan(tied, budget=10_000, closed=True) == {}
    # Open (requests wait to be admitted): every finished request makes room; they draft.
    assert len(drafter.plan(tied, budget=10_000, closed=False)) == 8
    # One laggard, the rest ahead: only the laggard drafts.
    laggard = _decoding(list(tokens), 9, 0.5, num_output=5, ignore_eos=True)
    plan = drafter.plan([*tied, laggard], budget=10_000, closed=True)
    assert list(plan) == [laggard]
    # Sure ones, tied: all of them draft.
    sure = [_decoding(list(tokens), i, 0.99, num_output=10, ignore_eos=True) for i in range(4)]
    assert len(drafter.plan(sure, budget=10_000, closed=True)) == 4


def test_a_request_that_stops_drafting_tries_again_later():
    drafter = Drafter(RadixCache(BlockPool(8, 4)), StepCost(), max_draft=8)
    pattern = [3, 4, 5, 6, 7, 8]
    reqs = [_decoding([*pattern, 3, 4], i, 0.01) for i in range(32)]
    steps = 0
    while not drafter.plan(reqs, budget=10_000, closed=False):
        steps += 1
        assert steps < 500, "a request that stopped drafting never tried again"
    assert steps > 10


# ---- the acceptance rule's distribution -----------------------------------------------------

SAMPLES = 20_000


@pytest.fixture(scope="module")
def tiny_logits(tmp_path_factory) -> torch.Tensor:
    """A next-token logits row of a tiny random llama (vocab 160)."""
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("spec_parts") / "llama")
    runner = ModelRunner(folder, num_blocks=16, block_size=4)
    out = runner.forward([SequenceInput([5, 17, 42, 99, 3, 8], 0, [0, 1])])
    return out.logits[0].float()


def _expected(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from, computed here from its definition."""
    probs = torch.softmax(logits / params.temperature, dim=0)
    order = torch.sort(probs, descending=True, stable=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    sorted_keep = torch.ones(len(probs), dtype=torch.bool)
    if params.top_k > 0:
        sorted_keep[params.top_k :] = False
    if params.top_p < 1.0:
        before = torch.cumsum(order.values, 0) - order.values
        sorted_keep &= before < params.top_p
    keep[order.indices] = sorted_keep
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


def _p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit, bins with fewer than 5 expected pooled."""
    want = expected * counts.sum()
    small = want < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([want[~small], want[small].sum().reshape(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def _draw_with_draft(logits: torch.Tensor, params: SamplingParams, draft: int) -> torch.Tensor:
    rows = [SamplingRow(params, [], [], frozenset(), None)] * SAMPLES
    batch = logits.expand(SAMPLES, -1).contiguous()
    generator = torch.Generator().manual_seed(1234)
    picks, accepted = sample_with_drafts(batch, rows, [draft] * SAMPLES, generator)
    tokens = torch.tensor(picks.token_ids)
    assert accepted == (tokens == draft).tolist()
    return torch.bincount(tokens, minlength=logits.shape[0]).float()


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=20),
]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top_p", "top_k"])
def test_drafted_tokens_come_out_with_the_models_probabilities(tiny_logits, params):
    expected = _expected(tiny_logits, params)
    # A likely draft and an unlikely one: both branches of the rule carry mass.
    for rank in (0, 5):
        draft = int(torch.sort(expected, descending=True).indices[rank])
        counts = _draw_with_draft(tiny_logits, params, draft)
        assert _p_value(counts, expected) > 1e-3, (rank, counts[draft] / SAMPLES)
    # The rule's own distribution is the one defined above.
    got = target_probs(tiny_logits[None], [params])[0]
    assert torch.allclose(got / got.sum(), expected, atol=1e-6)


def _wrong_residual(probs: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    return probs  # a rejected draft drawn again from the whole distribution


@pytest.mark.parametrize("wrong", ["resample_all", "always_accept"])
def test_the_chi_square_test_fails_a_wrong_rule(tiny_logits, monkeypatch, wrong):
    """The test above can fail: with a deliberately broken rule it does."""
    params = PARAMS[0]
    expected = _expected(tiny_logits, params)
    draft = int(torch.sort(expected, descending=True).indices[2])
    if wrong == "resample_all":
        monkeypatch.setattr(acceptance, "residual_probs", _wrong_residual)
    else:  # accept whatever the draft's probability (as a greedy row would)
        monkeypatch.setattr(
            acceptance, "speculative_pick", lambda probs, drafts, rows, gen: drafts.clone()
        )
    counts = _draw_with_draft(tiny_logits, params, draft)
    assert _p_value(counts, expected) < 1e-6


def test_greedy_rows_accept_exactly_the_argmax(tiny_logits):
    best = int(tiny_logits.argmax())
    other = (best + 1) % tiny_logits.shape[0]
    rows = [SamplingRow(SamplingParams(temperature=0), [], [], frozenset(), None)] * 3
    logits = tiny_logits.expand(3, -1)
    picks, accepted = sample_with_drafts(logits, rows, [best, other, NO_DRAFT])
    assert picks.token_ids == [best] * 3
    assert accepted == [True, False, False]


def test_logprobs_of_drafted_rows_are_those_of_the_raw_logits(tiny_logits):
    params = SamplingParams(temperature=0.8, return_logprob=True, top_logprobs_num=3)
    rows = [SamplingRow(params, [], [], frozenset(), None)] * 4
    logits = tiny_logits.expand(4, -1)
    draft = int(tiny_logits.argmax())
    picks, _ = sample_with_drafts(logits, rows, [draft] * 4, torch.Generator().manual_seed(0))
    lp = torch.log_softmax(tiny_logits, 0)
    for token, value, top in zip(picks.token_ids, picks.logprobs, picks.top_logprobs, strict=True):
        assert math.isclose(value, float(lp[token]), abs_tol=1e-6)
        assert [t for t, _ in top] == lp.topk(3).indices.tolist()
