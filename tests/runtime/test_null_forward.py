"""The null forward (``radixlang.testing.NullForward``) through the real engine, and the host
paths made fast for it: each must give exactly what the straightforward code gave.

- sampling: the candidate shortcut for top-k/top-p rows on the CPU against the topk way, the
  greedy argmax against torch's, batched uniform draws against one draw per row;
- the model runner's packed batch against a reference built the original way, tensor by
  tensor, and its refusals against the per-sequence checks;
- the request's live output view and the engine's per-request sampling row.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixlang.runtime import sampling
from radixlang.runtime.block_pool import blocks_for
from radixlang.runtime.engine import Engine
from radixlang.runtime.model_runner import BatchError, ModelRunner, SequenceInput
from radixlang.runtime.request import FinishReason, TokenTail
from radixlang.runtime.sampling import SamplingParams, SamplingRow, sample
from radixlang.testing import NullForward


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the null forward through the engine -----------------------------------------------------
@pytest.fixture
def engine(chat_model_dir):
    eng = Engine(
        chat_model_dir,
        num_blocks=400,
        block_size=4,
        dtype="float32",
        background=False,
        check_integrity_every_step=True,
    )
    yield eng
    eng.shutdown()


def test_null_forward_runs_the_engine(engine):
    null = NullForward.install(engine, bank_rows=64)
    rng = random.Random(0)
    requests = []
    for i in range(12):
        sampling_params = {"max_new_tokens": rng.randrange(1, 14), "ignore_eos": True}
        if i % 3 == 0:
            sampling_params["temperature"] = 0.0
        elif i % 3 == 1:
            sampling_params.update(temperature=0.7, top_p=0.9, seed=i)
        prompt = f"Request {i}: say something about {['the sea', 'cats', 'trees'][i % 3]}."
        requests.append((engine.submit(prompt, sampling_params), sampling_params))
    steps = 0
    while not all(handle.done for handle, _ in requests):
        engine.step()
        steps += 1
    tokenizer = engine.tokenizer
    for handle, params in requests:
        result = handle.result()
        assert result.finish_reason is FinishReason.LENGTH
        assert result.completion_tokens == len(result.output_ids) == params["max_new_tokens"]
        assert result.text == tokenizer.decode(result.output_ids, skip_special_tokens=True)
    assert null.calls == steps and null.rows >= 12
    engine.check_integrity()
    assert engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_blocks  # no block leaked
    null.uninstall()
    assert "forward" not in vars(engine.runner.model)


def test_greedy_tokens_are_the_argmax_of_the_rows_handed_out(engine):
    null = NullForward.install(engine, bank_rows=16)
    result = engine.generate("Hello there", {"temperature": 0, "max_new_tokens": 20})
    assert result.completion_tokens == 20
    # One sequence: call c (from 1) hands out bank row c mod 16; the first call is the prefill.
    expected = [int(null.bank[c % 16].argmax()) for c in range(1, 21)]
    assert result.output_ids == expected


# ---- sampling shortcuts ------------------------------------------------------------------------
def _random_rows(rng: random.Random, n: int, vocab: int) -> tuple[list[dict], list[int | None]]:
    configs, seeds = [], []
    for _ in range(n):
        kind = rng.random()
        config: dict = {"temperature": rng.choice([0.0, 0.3, 0.7, 1.0, 1.5, 1e-4])}
        if kind < 0.5:
            config["top_p"] = rng.choice([0.5, 0.8, 0.9, 0.95, 0.999])
        elif kind < 0.7:
            config["top_k"] = rng.choice([2, 20, 400, 1500, vocab + 5])
        elif kind < 0.85:
            config.update(top_p=rng.choice([0.9, 0.95]), top_k=rng.choice([10, 40, 1500]))
        if rng.random() < 0.2:
            config["min_p"] = rng.choice([0.01, 0.1, 0.3])
        configs.append(config)
        seeds.append(rng.choice([None, rng.randrange(1000)]))
    return configs, seeds


def _sample(logits, configs, seeds, shared):
    rows = [
        SamplingRow(SamplingParams(**c), [1], [2], frozenset(), None if s is None else gen(s))
        for c, s in zip(configs, seeds, strict=True)
    ]
    return sample(logits, rows, gen(shared)).token_ids


@pytest.mark.parametrize("vocab", [49152, 5003])
def test_candidate_shortcut_picks_what_the_topk_way_picks(monkeypatch, vocab):
    rng = random.Random(vocab)
    settled = []
    candidates = sampling._sample_candidates

    def spy(probs, params, u):
        tokens, done = candidates(probs, params, u)
        settled.extend(done.tolist())
        return tokens, done

    for trial in range(12):
        n = rng.choice([1, 5, 24])
        logits = torch.randn(n, vocab, generator=gen(trial)) * rng.choice([0.3, 2, 4, 12])
        if trial % 3 == 1:
            logits = logits.bfloat16().float()  # ties among the top tokens
        if trial % 4 == 2:
            logits[0, 7] = float("nan")
        configs, seeds = _random_rows(rng, n, vocab)
        monkeypatch.setattr(sampling, "_sample_candidates", spy)
        shortcut = _sample(logits, configs, seeds, trial)
        monkeypatch.setattr(sampling, "_CANDIDATES_MIN_VOCAB", 10**9)  # the topk way only
        assert _sample(logits, configs, seeds, trial) == shortcut, f"trial {trial}"
        monkeypatch.undo()
    assert sum(settled) > len(settled) // 3  # the shortcut did settle most rows it saw


def test_candidate_shortcut_settles_rows_exactly_at_both_thresholds(monkeypatch):
    # Peaked rows settle at the first threshold, flatter ones at the second, flat ones not at
    # all (they take the topk, then the full sort); the tokens never differ from the topk way.
    vocab, n = 49152, 30
    scale = torch.tensor([12.0, 4.0, 1.0]).repeat(n // 3).unsqueeze(1)
    logits = torch.randn(n, vocab, generator=gen(5)) * scale
    configs = [{"top_p": 0.9}, {"top_p": 0.95, "temperature": 1.3}, {"top_k": 50}] * (n // 3)
    shortcut = _sample(logits, configs, [None] * n, 1)
    monkeypatch.setattr(sampling, "_CANDIDATES_MIN_VOCAB", 10**9)
    assert _sample(logits, configs, [None] * n, 1) == shortcut


def test_greedy_argmax_keeps_torchs_ties_and_nans():
    logits = torch.randint(0, 4, (40, 3000)).float()
    logits[3, 100] = float("nan")
    logits[4] = float("-inf")
    logits[5, 7:9] = float("nan")
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], [], frozenset(), None)] * 40
    assert sample(logits, rows).token_ids == logits.argmax(dim=1).tolist()
    half = logits[:, ::2]  # not contiguous
    assert sample(half, rows).token_ids == half.argmax(dim=1).tolist()


def test_batched_draws_equal_one_draw_per_row():
    shared = gen(3)
    own = [gen(10), gen(11)]
    layout = [None, None, own[0], own[0], None, own[1], None]
    rows = [SamplingRow(SamplingParams(), [], [], frozenset(), g) for g in layout]
    drawn = sampling._draw(rows, shared)
    shared_ref, own_ref = gen(3), [gen(10), gen(11)]
    expected = []
    for g in layout:
        ref = shared_ref if g is None else own_ref[own.index(g)]
        expected.append(torch.rand(1, generator=ref))
    assert torch.equal(drawn, torch.cat(expected))
    assert torch.equal(shared.get_state(), shared_ref.get_state())


# ---- the packed batch ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(chat_model_dir):
    return ModelRunner(chat_model_dir, num_blocks=64, block_size=4)


def reference_batch(seqs, block_size):
    """The packed batch built as the runner first built it: a tensor op per step."""
    extend_lens = [len(s.tokens) for s in seqs]
    prefix_lens = [s.prefix_len for s in seqs]
    counts = [blocks_for(p + n, block_size) for p, n in zip(prefix_lens, extend_lens, strict=True)]
    tables = torch.zeros(len(seqs), max(counts), dtype=torch.int32)
    for row, (seq, count) in enumerate(zip(seqs, counts, strict=True)):
        tables[row, :count] = torch.tensor(list(seq.block_table[:count]), dtype=torch.int32)
    ext = torch.tensor(extend_lens)
    prefix = torch.tensor(prefix_lens)
    owner = torch.repeat_interleave(torch.arange(len(seqs)), ext)
    starts = torch.cumsum(ext, 0) - ext
    positions = prefix[owner] + torch.arange(len(owner)) - starts[owner]
    slots = tables[owner, positions // block_size].long() * block_size + positions % block_size
    return {
        "input_ids": torch.tensor([t for s in seqs for t in s.tokens]),
        "positions": positions,
        "slot_mapping": slots,
        "block_tables": tables,
        "prefix_lens": prefix.to(torch.int32),
        "extend_lens": ext.to(torch.int32),
        "seq_lens": (prefix + ext).to(torch.int32),
    }


def random_seqs(rng: random.Random, decode_only: bool) -> list[SequenceInput]:
    seqs = []
    for _ in range(rng.randrange(1, 9)):
        n = 1 if decode_only or rng.random() < 0.5 else rng.randrange(2, 12)
        prefix = rng.randrange(0, 30)
        table = rng.sample(range(64), blocks_for(prefix + n, 4) + rng.randrange(0, 2))
        tokens = [rng.randrange(49152) for _ in range(n)]
        seqs.append(SequenceInput(tokens, prefix, table, return_logprobs=rng.random() < 0.2))
    # extends first, as the runner orders them before building
    return sorted(seqs, key=lambda s: len(s.tokens) == 1)


@pytest.mark.parametrize("decode_only", [True, False])
def test_packed_batch_equals_the_reference(runner, decode_only):
    rng = random.Random(int(decode_only))
    for _ in range(40):
        seqs = random_seqs(rng, decode_only)
        rows = list(range(len(seqs)))
        batch, logit_rows = runner._build_batch(seqs, rows)
        assert logit_rows.tolist() == rows
        for name, want in reference_batch(seqs, 4).items():
            got = getattr(batch, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        n_ext = sum(len(s.tokens) > 1 for s in seqs)
        assert batch.num_extend_seqs == n_ext
        assert batch.num_extend_tokens == sum(len(s.tokens) for s in seqs[:n_ext])
        assert batch.host_prefix_lens == [s.prefix_len for s in seqs]


def test_the_first_bad_sequence_in_the_given_order_is_reported(runner):
    good = SequenceInput([5], 3, [1])
    bad_token = SequenceInput([49152], 0, [2])
    short_table = SequenceInput([1, 2, 3, 4, 5], 0, [3])
    with pytest.raises(BatchError, match="token ids"):
        runner.forward([good, bad_token, short_table])
    with pytest.raises(BatchError, match="need 2 blocks"):
        runner.forward([short_table, good, bad_token])
    with pytest.raises(BatchError, match="block ids"):
        runner.forward([good, SequenceInput([7], 0, [64])])


def test_a_one_token_sequence_still_gets_its_logprobs(runner):
    out = runner.forward(
        [
            SequenceInput([5], 0, [1], return_logprobs=True, top_logprobs=2),
            SequenceInput([6], 0, [2]),
        ]
    )
    assert out.logits.shape[0] == 2
    assert out.prompt_logprobs[0] is not None and out.prompt_logprobs[0].numel() == 0
    assert out.prompt_top_logprobs[0] is not None and out.prompt_logprobs[1] is None


# ---- request state ---------------------------------------------------------------------------
def test_token_tail_is_a_live_view():
    tokens = [1, 2, 3]
    tail = TokenTail(tokens, 2)
    assert list(tail) == [3] and len(tail) == 1 and tail[0] == 3 and tail[-1] == 3
    tokens += [4, 5]
    assert list(tail) == [3, 4, 5] and len(tail) == 3 and tail[1:] == [4, 5]
    assert tail == [3, 4, 5] and 4 in tail and set(tail) == {3, 4, 5}
    assert len(TokenTail([1], 2)) == 0 and not TokenTail([1], 2)


def test_detokenizers_sharing_a_tokenizer_keep_their_own_way_of_decoding(engine):
    from radixlang.runtime.detokenizer import IncrementalDetokenizer

    tokenizer = engine.tokenizer
    rng = random.Random(1)
    ids = [rng.choice([rng.randrange(20), rng.randrange(49152)]) for _ in range(300)]
    for _ in range(2):  # the second round reads the texts the first one remembered
        for skip in (True, False, True):
            detok = IncrementalDetokenizer(tokenizer, [], (), skip)
            text = "".join(detok.push(i) for i in ids) + detok.flush()
            assert text == tokenizer.decode(ids, skip_special_tokens=skip)
