import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlang.runtime import sampling
from radixlang.runtime.sampling import (
    SampleOutput,
    SamplingParams,
    SamplingParamsError,
    SamplingRow,
    sample,
)


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def make_row(
    params: SamplingParams | None = None,
    *,
    prompt=(),
    output=(),
    stop_ids=frozenset(),
    generator: torch.Generator | None = None,
    mask: torch.Tensor | None = None,
    **kw,
) -> SamplingRow:
    p = params if params is not None else SamplingParams(**kw)
    return SamplingRow(p, list(prompt), list(output), frozenset(stop_ids), generator, mask)


def greedy_pick(logits: list[float], **kw) -> int:
    return sample(torch.tensor([logits]), [make_row(temperature=0.0, **kw)]).token_ids[0]


def counts_of(out: SampleOutput, vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * observed.sum()
    keep = expected > 0
    assert observed[~keep].sum() == 0, "drew a token of probability zero"
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def draw_many(logits: torch.Tensor, n: int, seed: int = 0, **kw) -> SampleOutput:
    """n independent draws from one row of logits, via one batch sharing a seeded generator."""
    params = SamplingParams(**kw)
    rows = [make_row(params) for _ in range(n)]
    return sample(logits.expand(n, -1).contiguous(), rows, generator=gen(seed))


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", -1),
        ("max_new_tokens", "5"),
        ("max_new_tokens", True),
        ("max_new_tokens", 4.0),
        ("min_new_tokens", -1),
        ("min_new_tokens", 129),  # > max_new_tokens (128)
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("temperature", False),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 3),
        ("presence_penalty", -3.0),
        ("seed", "1"),
        ("seed", True),
        ("seed", 2**64),
        ("stop", [""]),
        ("stop", ""),
        ("stop", [1]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("stop_token_ids", "12"),
        ("stop_token_ids", [True]),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", 1),
        ("return_logprob", None),
        ("top_logprobs_num", -1),
        ("logprob_start_len", -2),
    ],
)
def test_invalid_field_is_rejected_with_its_name(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_error_is_a_value_error_and_validate_rechecks_after_mutation():
    assert issubclass(SamplingParamsError, ValueError)
    p = SamplingParams()
    p.validate()
    p.top_p = 2.0
    with pytest.raises(SamplingParamsError, match="top_p"):
        p.validate()


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k) == (
        128,
        0,
        1.0,
        1.0,
        -1,
    )
    assert (p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (
        0.0,
        1.0,
        0.0,
        0.0,
    )
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.skip_special_tokens and not p.return_logprob
    assert p.top_logprobs_num == 0 and p.logprob_start_len == -1
    assert not p.is_greedy

    q = SamplingParams(top_k=0, stop="END", stop_token_ids=(3, 4), temperature=0, top_p=1)
    assert q.top_k == -1
    assert q.stop == ["END"]
    assert q.stop_token_ids == [3, 4]
    assert isinstance(q.temperature, float) and isinstance(q.top_p, float)
    assert q.is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(top_k=2, temperature=0.5).is_greedy
    assert SamplingParams(max_new_tokens=0).max_new_tokens == 0  # prefill only is valid
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []


def test_from_dict():
    p = SamplingParams.from_dict(
        {"max_new_tokens": 8, "temperature": 0.5, "stop": "\n", "seed": 3, "top_k": None}
    )
    assert (p.max_new_tokens, p.temperature, p.stop, p.seed, p.top_k) == (8, 0.5, ["\n"], 3, -1)

    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams.from_dict({"temperature": 0.5, "max_tokens": 5, "best_of": 2})
    msg = str(exc.value)
    assert "max_tokens" in msg and "best_of" in msg
    assert "valid keys" in msg and "max_new_tokens" in msg and "top_logprobs_num" in msg

    with pytest.raises(SamplingParamsError, match="max_new_tokens"):
        SamplingParams.from_dict({"max_new_tokens": "5"})
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_draws_nothing():
    logits = torch.randn(64, 1000, generator=gen(1))
    gens = [gen(i) for i in range(64)]
    rows = [make_row(temperature=0.0, generator=g) for g in gens]
    out = sample(logits, rows)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs == [None] * 64 and out.top_logprobs == [None] * 64
    for i, g in enumerate(gens):
        assert torch.equal(g.get_state(), gen(i).get_state())


def test_greedy_with_allowed_mask_picks_best_allowed():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    mask = torch.tensor([False, False, True, True, False])
    rows = [make_row(temperature=0.0, mask=mask), make_row(temperature=0.0)]
    assert sample(logits, rows).token_ids == [2, 0]


def test_top_k_one_equals_greedy_and_draws_nothing():
    logits = torch.randn(32, 500, generator=gen(2))
    g = gen(9)
    rows = [make_row(temperature=1.5, top_k=1, generator=g) for _ in range(32)]
    assert sample(logits, rows).token_ids == logits.argmax(dim=1).tolist()
    assert torch.equal(g.get_state(), gen(9).get_state())


@pytest.mark.parametrize("temperature", [1e-4, 1e-30])
def test_temperature_to_zero_limit_is_argmax(temperature):
    logits = torch.randn(64, 1000, generator=gen(3)) * 3
    rows = [make_row(temperature=temperature, generator=gen(i)) for i in range(64)]
    assert sample(logits, rows).token_ids == logits.argmax(dim=1).tolist()


def test_logits_are_not_modified():
    logits = torch.randn(3, 50, generator=gen(4))
    before = logits.clone()
    rows = [
        make_row(temperature=0.0, prompt=[1, 2], repetition_penalty=1.5),
        make_row(output=[3, 3], frequency_penalty=1.0, generator=gen(0)),
        make_row(mask=torch.arange(50) < 10, output=[], stop_ids={4}, min_new_tokens=2),
    ]
    sample(logits, rows, generator=gen(1))
    assert torch.equal(logits, before)


def test_shape_errors_and_empty_batch():
    with pytest.raises(ValueError, match="len"):
        sample(torch.zeros(2, 5), [make_row()])
    with pytest.raises(ValueError, match="allowed_mask"):
        sample(torch.zeros(1, 5), [make_row(mask=torch.ones(4, dtype=torch.bool))])
    with pytest.raises(ValueError, match="masked"):
        sample(torch.zeros(1, 5), [make_row(mask=torch.zeros(5, dtype=torch.bool))])
    with pytest.raises(ValueError, match="prompt_ids"):
        sample(torch.zeros(1, 5), [make_row(prompt=[7], repetition_penalty=1.1)])
    out = sample(torch.zeros(0, 5), [])
    assert out == SampleOutput([], [], [])


# --------------------------------------------------------------------------- distributions


def test_temperature_one_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25]])
    out = draw_many(logits, 20000, seed=11)
    # df = 7: the 0.1% critical value is 24.3; a wrong distribution scores in the hundreds.
    assert chi_square(counts_of(out, 8), torch.softmax(logits[0], 0)) < 24.3


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25]])
    out = draw_many(logits, 20000, seed=12, temperature=temperature)
    observed = counts_of(out, 8)
    assert chi_square(observed, torch.softmax(logits[0] / temperature, 0)) < 24.3
    # And not the unscaled softmax: the scaling is real.
    assert chi_square(observed, torch.softmax(logits[0], 0)) > 200
    top_share = observed[0] / observed.sum()
    assert (top_share > 0.5) if temperature < 1 else (top_share < 0.3)


# Three designed tokens (0.30, 0.20, 0.10) at scattered ids; 61 others share 0.40 equally.
_VOCAB = 64
_A, _B, _C = 37, 5, 50


def _designed_logits() -> torch.Tensor:
    probs = torch.full((_VOCAB,), 0.40 / 61)
    probs[_A], probs[_B], probs[_C] = 0.30, 0.20, 0.10
    return probs.log().unsqueeze(0)


@pytest.mark.parametrize(
    ("kw", "allowed", "ratio"),
    [
        ({"top_k": 2}, {_A, _B}, [0.6, 0.4]),
        ({"top_k": 3}, {_A, _B, _C}, [0.5, 1 / 3, 1 / 6]),
        ({"top_p": 0.45}, {_A, _B}, [0.6, 0.4]),
        ({"top_p": 0.55}, {_A, _B, _C}, [0.5, 1 / 3, 1 / 6]),
        ({"min_p": 0.5}, {_A, _B}, [0.6, 0.4]),
        ({"min_p": 0.3}, {_A, _B, _C}, [0.5, 1 / 3, 1 / 6]),
        ({"top_k": 3, "top_p": 0.45}, {_A, _B}, [0.6, 0.4]),
        ({"top_p": 0.55, "min_p": 0.5}, {_A, _B}, [0.6, 0.4]),
        # Temperature comes first: at 0.5, A alone holds 63% of the mass, so top_p 0.6 keeps
        # only A (at temperature 1 it would keep A, B and C).
        ({"temperature": 0.5, "top_p": 0.6}, {_A}, [1.0]),
    ],
)
def test_filters_never_draw_a_filtered_token(kw, allowed, ratio):
    out = draw_many(_designed_logits(), 4000, seed=13, **kw)
    assert set(out.token_ids) == allowed
    observed = counts_of(out, _VOCAB)
    ids = [_A, _B, _C][: len(ratio)]
    probs = torch.zeros(_VOCAB)
    probs[ids] = torch.tensor(ratio)
    # Kept tokens keep their relative odds (df <= 2: 0.1% critical value 13.8).
    assert chi_square(observed, probs) < 13.8


def test_no_filter_keeps_the_long_tail():
    out = draw_many(_designed_logits(), 4000, seed=14)
    tail = sum(1 for t in out.token_ids if t not in (_A, _B, _C))
    assert 0.35 < tail / 4000 < 0.45


@pytest.mark.parametrize("candidates", [4096, 8])
def test_nucleus_candidates_shortcut_matches_a_full_sort(monkeypatch, candidates):
    # Peaked rows have a nucleus well inside the 1024 candidates; flat ones fall back to a
    # full sort. Either way the token must be the one a full sort picks for the same draw.
    vocab, n = 4096, 48
    scale = torch.tensor([0.3, 6.0, 12.0]).repeat(n // 3).unsqueeze(1)
    logits = torch.randn(n, vocab, generator=gen(17)) * scale
    configs = [{"top_p": 0.9}, {"top_p": 0.5, "temperature": 1.5}, {"top_p": 0.95, "min_p": 0.1}]

    def run() -> list[int]:
        rows = [make_row(generator=gen(i), **configs[i % 3]) for i in range(n)]
        return sample(logits, rows).token_ids

    shortcut = run()
    monkeypatch.setattr(sampling, "_NUCLEUS_CANDIDATES", candidates)
    assert run() == shortcut


def test_top_p_nucleus_larger_than_the_candidates():
    # Slowly decaying logits in id order: the 0.9 nucleus is ~2300 tokens, past the 1024
    # candidates, so this exercises the full-sort fallback.
    vocab, n = 4096, 400
    logits = -torch.arange(vocab, dtype=torch.float32) * 1e-3
    probs = torch.softmax(logits.double(), 0)
    nucleus = int(((torch.cumsum(probs, 0) - probs) < 0.9).sum())
    assert nucleus > 2000
    out = draw_many(logits.unsqueeze(0), n, seed=18, top_p=0.9)
    assert max(out.token_ids) < nucleus
    assert sum(t >= 1024 for t in out.token_ids) > n // 4


def test_allowed_mask_on_sampled_rows():
    mask = torch.zeros(_VOCAB, dtype=torch.bool)
    mask[[_C, 3, 60]] = True
    rows = [make_row(mask=mask) for _ in range(2000)]
    out = sample(_designed_logits().expand(2000, -1), rows, generator=gen(15))
    assert set(out.token_ids) == {_C, 3, 60}


# --------------------------------------------------------------------------- penalties


def _logits(values: dict[int, float], vocab: int = 6) -> list[float]:
    out = [-10.0] * vocab
    for i, v in values.items():
        out[i] = v
    return out


@pytest.mark.parametrize(("rival", "expected"), [(1.49, 0), (1.51, 1)])
def test_repetition_penalty_divides_positive_logits(rival, expected):
    # 3.0 / 2 = 1.5, counted once however often the token occurs, prompt tokens included.
    logits = _logits({0: 3.0, 1: rival})
    assert greedy_pick(logits, prompt=[0, 0, 0], repetition_penalty=2.0) == expected
    assert greedy_pick(logits, output=[0, 0], repetition_penalty=2.0) == expected
    assert greedy_pick(logits, prompt=[5], repetition_penalty=2.0) == 0  # 0 not seen


@pytest.mark.parametrize(("rival", "expected"), [(-1.99, 1), (-2.01, 0)])
def test_repetition_penalty_multiplies_negative_logits(rival, expected):
    logits = _logits({0: -1.0, 1: rival})
    assert greedy_pick(logits, output=[0], repetition_penalty=2.0) == expected


@pytest.mark.parametrize(("rival", "expected"), [(1.99, 0), (2.01, 1)])
def test_repetition_penalty_below_one_boosts(rival, expected):
    logits = _logits({0: 1.0, 1: rival})
    assert greedy_pick(logits, prompt=[0], repetition_penalty=0.5) == expected


@pytest.mark.parametrize(("rival", "expected"), [(1.49, 0), (1.51, 1)])
def test_frequency_penalty_scales_with_count(rival, expected):
    logits = _logits({0: 3.0, 1: rival})  # 3.0 - 0.5 * 3 = 1.5
    assert greedy_pick(logits, output=[0, 2, 0, 0], frequency_penalty=0.5) == expected


@pytest.mark.parametrize(("rival", "expected"), [(2.49, 0), (2.51, 1)])
def test_presence_penalty_counts_once(rival, expected):
    logits = _logits({0: 3.0, 1: rival})  # 3.0 - 0.5
    assert greedy_pick(logits, output=[0, 0, 0], presence_penalty=0.5) == expected


def test_frequency_and_presence_penalties_combine_and_ignore_the_prompt():
    logits = _logits({0: 3.0, 1: 1.51})  # 3.0 - 0.5 * 2 - 0.5 = 1.5
    kw = {"frequency_penalty": 0.5, "presence_penalty": 0.5}
    assert greedy_pick(logits, output=[0, 0], **kw) == 1
    assert greedy_pick(_logits({0: 3.0, 1: 1.49}), output=[0, 0], **kw) == 0
    # Prompt tokens are not "generated": no OpenAI penalty for them.
    assert greedy_pick(_logits({0: 3.0, 1: 2.9}), prompt=[0] * 10, output=[2], **kw) == 0
    # Negative values reward repeats: 1.0 + 2 * 1.0 = 3.0 beats 2.9.
    assert greedy_pick(_logits({0: 2.9, 1: 1.0}), output=[1, 1], frequency_penalty=-1.0) == 1


def test_repetition_penalty_applies_before_frequency_penalty():
    # rep then freq: 3.0 / 2 - 0.5 = 1.0 < 1.1; freq then rep would give 1.25 > 1.1.
    logits = _logits({0: 3.0, 1: 1.1})
    assert greedy_pick(logits, output=[0], repetition_penalty=2.0, frequency_penalty=0.5) == 1


def test_penalties_apply_to_sampled_rows_and_only_their_own_row():
    logits = torch.tensor([_logits({0: 3.0, 1: 2.0})] * 3)
    rows = [
        make_row(temperature=1e-3, output=[0], presence_penalty=2.0, generator=gen(0)),
        make_row(temperature=1e-3, generator=gen(1)),
        make_row(temperature=0.0, prompt=[0], repetition_penalty=1.6),
    ]
    assert sample(logits, rows).token_ids == [1, 0, 1]


# --------------------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_masks_stop_ids_until_reached():
    logits = _logits({0: 5.0, 1: 1.0, 2: 4.0})
    stop = {0, 2, 10**6}  # an id outside the vocab is simply ignored
    for generated in range(3):
        assert greedy_pick(logits, output=[1] * generated, stop_ids=stop, min_new_tokens=3) == 1
    assert greedy_pick(logits, output=[1] * 3, stop_ids=stop, min_new_tokens=3) == 0
    assert greedy_pick(logits, stop_ids=set(), min_new_tokens=3) == 0  # nothing to mask

    n = 2000
    rows = [make_row(output=[1], stop_ids={0, 2}, min_new_tokens=2) for _ in range(n)]
    out = sample(torch.tensor([logits] * n), rows, generator=gen(16))
    assert 0 not in out.token_ids and 2 not in out.token_ids
    assert set(out.token_ids) == {1}  # everything else sits at -10


# --------------------------------------------------------------------------- reproducibility

_TARGET_CONFIGS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"top_k": 20, "min_p": 0.05},
    {
        "temperature": 1.3,
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.3,
        "presence_penalty": 0.2,
        "min_new_tokens": 2,
    },
    {"top_p": 0.8, "mask": True},
]


def _random_row(rng: random.Random, vocab: int) -> SamplingRow:
    kind = rng.choice(["greedy", "plain", "top_p", "top_k", "min_p", "pen", "mask"])
    kw: dict = {}
    if kind == "greedy":
        kw["temperature"] = 0.0
    elif kind == "top_p":
        kw.update(top_p=rng.uniform(0.1, 0.99), temperature=rng.uniform(0.2, 2.0))
    elif kind == "top_k":
        kw["top_k"] = rng.randint(2, 50)
    elif kind == "min_p":
        kw["min_p"] = rng.uniform(0.0, 0.5)
    elif kind == "pen":
        kw.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=-0.5)
    mask = torch.rand(vocab, generator=gen(rng.randrange(1000))) < 0.3 if kind == "mask" else None
    if mask is not None:
        mask[0] = True
    generator = gen(rng.randrange(10**6)) if rng.random() < 0.5 else None
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
    return make_row(prompt=prompt, output=output, generator=generator, mask=mask, **kw)


def _run_target(
    config: dict, vocab: int, steps: int, batch_of: list[tuple[int, int]] | None
) -> tuple[list[int], torch.Generator]:
    """Generate `steps` tokens for a seeded target row; batch_of[s] = (batch size, position)."""
    kw = dict(config)
    mask = None
    if kw.pop("mask", False):
        mask = torch.arange(vocab) % 3 == 0
    g = gen(1234)
    rng = random.Random(99)
    tokens: list[int] = []
    for s in range(steps):
        target_logits = torch.randn(vocab, generator=gen(1000 + s)) * 2
        target = make_row(
            prompt=[1, 2, 3], output=tokens, stop_ids={0}, generator=g, mask=mask, **kw
        )
        if batch_of is None:
            out = sample(target_logits.unsqueeze(0), [target])
            tokens.append(out.token_ids[0])
            continue
        size, pos = batch_of[s]
        rows = [_random_row(rng, vocab) for _ in range(size)]
        logits = torch.randn(size, vocab, generator=gen(rng.randrange(10**6))) * 3
        rows[pos] = target
        logits[pos] = target_logits
        out = sample(logits, rows, generator=gen(rng.randrange(10**6)))
        tokens.append(out.token_ids[pos])
    return tokens, g


@pytest.mark.parametrize("config", _TARGET_CONFIGS)
@settings(max_examples=10, deadline=None)
@given(
    layout=st.lists(
        st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1))),
        min_size=4,
        max_size=4,
    )
)
def test_seeded_row_is_independent_of_its_batch(config, layout):
    alone, g_alone = _run_target(config, 256, 4, None)
    batched, g_batched = _run_target(config, 256, 4, layout)
    assert batched == alone
    # Exactly one uniform per sampled token, so the generator ends in the same state too.
    assert torch.equal(g_alone.get_state(), g_batched.get_state())


def test_one_draw_per_sampled_token():
    g = gen(5)
    ref = gen(5)
    for step in range(3):
        sample(torch.randn(1, 100, generator=gen(step)), [make_row(top_p=0.5, generator=g)])
        torch.rand(1, generator=ref)
        assert torch.equal(g.get_state(), ref.get_state())


@pytest.mark.parametrize("config", [{"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.0}])
def test_seeded_row_is_independent_of_its_batch_at_real_vocab_size(config):
    vocab = 49152
    alone, _ = _run_target(config, vocab, 2, None)
    assert _run_target(config, vocab, 2, [(12, 0), (9, 8)])[0] == alone
    assert _run_target(config, vocab, 2, [(7, 3), (3, 2)])[0] == alone


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(1, 1000)

    def run(seed: int) -> list[int]:
        g = gen(seed)
        return [sample(logits, [make_row(generator=g)]).token_ids[0] for _ in range(10)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_rows_without_generator_share_the_argument_in_row_order():
    logits = torch.randn(3, 300, generator=gen(6))
    a, b = make_row(), make_row(top_p=0.9)
    greedy = make_row(temperature=0.0)
    together = sample(logits, [a, greedy, b], generator=gen(7)).token_ids
    g = gen(7)
    first = sample(logits[0:1], [a], generator=g).token_ids[0]
    second = sample(logits[2:3], [b], generator=g).token_ids[0]
    assert together == [first, int(logits[1].argmax()), second]


def test_default_torch_generator_when_none_given():
    logits = torch.zeros(4, 1000)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        first = sample(logits, [make_row() for _ in range(4)]).token_ids
        torch.manual_seed(3)
        second = sample(logits, [make_row() for _ in range(4)]).token_ids
    assert first == second
    assert len(set(first)) > 1


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_those_of_the_raw_logits():
    vocab = 100
    logits = torch.randn(4, vocab, generator=gen(8)) * 2
    raw_lp = torch.log_softmax(logits, dim=1)
    rows = [
        make_row(
            return_logprob=True,
            top_logprobs_num=5,
            temperature=0.7,
            top_p=0.8,
            output=[1, 2],
            frequency_penalty=1.0,
            repetition_penalty=1.3,
            mask=torch.arange(vocab) >= 50,
            generator=gen(0),
        ),
        make_row(top_logprobs_num=5, generator=gen(1)),  # no return_logprob: nothing
        make_row(return_logprob=True, temperature=0.0),
        make_row(return_logprob=True, top_logprobs_num=vocab + 10, generator=gen(2)),
    ]
    out = sample(logits, rows)
    assert out.token_ids[0] >= 50  # the mask was honoured
    assert out.token_ids[2] == int(logits[2].argmax())
    for i in (0, 2, 3):
        assert out.logprobs[i] == pytest.approx(float(raw_lp[i, out.token_ids[i]]), abs=1e-5)
    assert out.logprobs[1] is None
    assert out.top_logprobs[1] is None and out.top_logprobs[2] is None

    top = out.top_logprobs[0]
    assert top is not None and len(top) == 5
    expected_ids = raw_lp[0].argsort(descending=True)[:5].tolist()
    assert [t for t, _ in top] == expected_ids
    for t, v in top:
        assert v == pytest.approx(float(raw_lp[0, t]), abs=1e-5)
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)

    full = out.top_logprobs[3]
    assert full is not None and len(full) == vocab  # clamped to the vocab
    assert sorted(t for t, _ in full) == list(range(vocab))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_with_cpu_generators():
    vocab = 49152
    logits = torch.randn(8, vocab, generator=gen(19)) * 4
    mask = torch.arange(vocab) % 2 == 0  # a CPU mask: moved to the logits' device

    def rows() -> list[SamplingRow]:
        return [
            make_row(temperature=0.0, return_logprob=True, top_logprobs_num=3),
            make_row(temperature=0.0, prompt=[1, 2], repetition_penalty=1.3, mask=mask),
            *[
                make_row(generator=gen(i), output=[3, 3], frequency_penalty=0.5, **cfg)
                for i, cfg in enumerate(
                    [{}, {"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.1}, {"temperature": 0.5}]
                )
            ],
            make_row(),  # the shared generator
        ]

    cpu = sample(logits, rows(), generator=gen(0))
    cuda = sample(logits.cuda(), rows(), generator=gen(0))
    assert cuda.token_ids[:2] == cpu.token_ids[:2]
    assert cuda.token_ids[1] % 2 == 0
    assert cuda.logprobs[0] == pytest.approx(cpu.logprobs[0], abs=1e-4)
    assert [t for t, _ in cuda.top_logprobs[0]] == [t for t, _ in cpu.top_logprobs[0]]
    # On the device too, a seeded row does not depend on its batch.
    for i in range(2, 7):
        alone = sample(logits[i : i + 1].cuda(), [rows()[i]]).token_ids[0]
        assert alone == cuda.token_ids[i]


# --------------------------------------------------------------------------- logit_bias


@pytest.mark.parametrize(("bias", "expected"), [(1.99, 0), (2.01, 1)])
def test_logit_bias_adds_to_the_logit(bias, expected):
    logits = _logits({0: 3.0, 1: 1.0})
    assert greedy_pick(logits, logit_bias={1: bias}) == expected
    assert greedy_pick(logits, logit_bias={"1": bias}) == expected  # JSON's string keys


def test_logit_bias_bans_and_forces_sampled_tokens_and_leaves_logprobs_raw():
    logits = torch.randn(1, 50, generator=gen(3))
    best = int(logits.argmax())
    banned = draw_many(logits, 400, logit_bias={best: -100.0})
    assert best not in banned.token_ids
    forced = draw_many(logits, 50, logit_bias={7: 100.0}, return_logprob=True)
    assert set(forced.token_ids) == {7}
    raw = torch.log_softmax(logits[0], dim=0)[7].item()
    assert forced.logprobs[0] == pytest.approx(raw)  # the model's, not the biased one


def test_logit_bias_never_overrides_a_mask():
    mask = torch.tensor([True, True, False, False])
    logits = torch.tensor([[1.0, 0.5, 0.0, 0.0]])
    row = make_row(temperature=0.0, mask=mask, logit_bias={2: 100.0})
    assert sample(logits, [row]).token_ids == [0]


@pytest.mark.parametrize(
    "bias", [{"x": 1.0}, {-1: 1.0}, {1: 101.0}, {1: float("nan")}, {1: "big"}, [1, 2], {True: 1}]
)
def test_bad_logit_bias_is_rejected(bias):
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
