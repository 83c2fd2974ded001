"""Sliding-window models (Mistral's ``sliding_window``) in the engine: outputs as transformers'
past the window, and KV blocks before every running request's window released, so that a pool
smaller than a request's context still runs it to the end without leaking a block."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import WINDOWS, load_reference, make_tiny_model, reference_greedy, stepped_engine

from radixlang.runtime.block_pool import RELEASED, dead_blocks
from radixlang.runtime.engine import Engine
from radixlang.runtime.model_runner import BatchError, ModelRunner, SequenceInput
from radixlang.runtime.request import FinishReason

VOCAB = 160
GREEDY = {"temperature": 0, "ignore_eos": True}
WINDOW = WINDOWS["mistral_window"]  # 8
BLOCK = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    return make_tiny_model("mistral_window", root / "mistral", seed=3, max_position_embeddings=512)


@pytest.fixture(scope="module")
def reference(folder):
    return load_reference(folder)


def engine(folder, **kw) -> Engine:
    kw.setdefault("block_size", BLOCK)
    return stepped_engine(folder, **kw)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def all_free_after_flush(eng: Engine) -> None:
    eng.check_integrity()
    assert eng.cache.protected_size() == 0
    assert eng.flush_cache()
    assert eng.pool.num_free == eng.pool.num_blocks


def test_the_window_reaches_the_runner_and_the_scheduler(folder):
    eng = engine(folder, num_blocks=16)
    assert eng.runner.sliding_window == WINDOW == eng.scheduler.sliding_window
    # The context is the model's, not the window, and not the pool's 64 slots.
    assert eng.max_context == 512
    assert eng.runner.describe()["sliding_window"] == WINDOW


def test_greedy_past_the_window_matches_transformers(folder, reference):
    """Alone, then in one batch with other requests, one of them hitting a cached prefix."""
    a, b, c = prompts(1, [13, 30, 5])
    hit = a[:11] + prompts(2, [6])[0]  # shares 11 tokens (inside a block) with a
    n = 40
    want = {tuple(p): reference_greedy(reference, p, n) for p in (a, b, c, hit)}
    eng = engine(folder)
    assert eng.generate(a, GREEDY | {"max_new_tokens": n}).output_ids == want[tuple(a)]
    # a's prompt is cached now (its generation released its first blocks: not inserted).
    got = eng.generate([hit, b, c], [GREEDY | {"max_new_tokens": n}] * 3)
    assert [r.output_ids for r in got] == [want[tuple(p)] for p in (hit, b, c)]
    assert got[0].cached_tokens == 11
    all_free_after_flush(eng)


def test_running_requests_hold_only_their_windows(folder):
    eng = engine(folder, max_batch_tokens=6)  # prompts prefilled in chunks
    (p,) = prompts(3, [27])
    handle = eng.submit(p, GREEDY | {"max_new_tokens": 30})
    while not handle.done:
        eng.step()
        for req in eng.scheduler.running:
            dead = dead_blocks(req.num_computed, WINDOW, BLOCK)
            assert req.blocks[:dead] == [RELEASED] * dead
            assert RELEASED not in req.blocks[dead:]
            live = len(req.blocks) - dead
            assert live <= -(-(WINDOW + 6) // BLOCK) + 1
    assert handle.result().finish_reason is FinishReason.LENGTH
    all_free_after_flush(eng)


def test_a_pool_smaller_than_the_context_runs_long_generations(folder, reference):
    """Eight blocks (32 slots, four windows) for a 20-token prompt and 100 new tokens, then a
    60-token prompt, then three requests at once (which must take turns)."""
    (short,) = prompts(4, [20])
    want = reference_greedy(reference, short, 100)
    eng = engine(folder, num_blocks=8)
    r = eng.generate(short, GREEDY | {"max_new_tokens": 100})
    assert r.finish_reason is FinishReason.LENGTH and r.output_ids == want
    all_free_after_flush(eng)

    (long,) = prompts(5, [60])
    r = eng.generate(long, GREEDY | {"max_new_tokens": 30})
    assert r.output_ids == reference_greedy(reference, long, 30)
    all_free_after_flush(eng)

    many = prompts(6, [9, 17, 25])
    params = [GREEDY | {"max_new_tokens": 45}] * 3
    want_many = engine(folder).generate(many, params)
    got = eng.generate(many, params)
    assert [g.output_ids for g in got] == [w.output_ids for w in want_many]
    all_free_after_flush(eng)


def test_random_traffic_on_a_small_pool_keeps_every_invariant(folder):
    rng = random.Random(7)
    items = [
        (p, rng.randrange(1, 50)) for p in prompts(8, [rng.randrange(2, 40) for _ in range(14)])
    ]
    for i in range(1, len(items), 3):  # shared prefixes
        items[i] = (items[i - 1][0][: rng.randrange(1, 12)] + items[i][0], items[i][1])
    params = [GREEDY | {"max_new_tokens": n} for _, n in items]
    want = engine(folder).generate([p for p, _ in items], params)
    eng = engine(folder, num_blocks=12, max_batch_tokens=10, max_running_requests=6)
    handles = []
    pending = list(range(len(items)))
    while pending or not all(h.done for h in handles):
        for _ in range(rng.randrange(0, 3)):
            if pending:
                i = pending.pop(0)
                handles.append(eng.submit(items[i][0], params[i]))
        eng.step()
    assert [h.result().output_ids for h in handles] == [w.output_ids for w in want]
    all_free_after_flush(eng)


def test_the_runner_takes_released_entries_only_before_the_window(folder):
    runner = ModelRunner(folder, num_blocks=16, block_size=BLOCK)
    tokens = prompts(9, [21])[0]
    table = list(range(6))
    whole = runner.forward([SequenceInput(tokens[:20], 0, table)])
    # Position 20's window starts at 13: blocks 0..2 (positions 0..11) are dead, block 3 not.
    dead = dead_blocks(20, WINDOW, BLOCK)
    assert dead == 3
    released = [RELEASED] * dead + table[dead:]
    got = runner.forward([SequenceInput(tokens[20:], 20, released)])
    again = runner.forward([SequenceInput(tokens[20:], 20, table)])
    torch.testing.assert_close(got.logits, again.logits, atol=0, rtol=0)
    assert whole.logits.isfinite().all()
    too_many = [RELEASED] * (dead + 1) + table[dead + 1 :]
    with pytest.raises(BatchError, match="released ones only before the window"):
        runner.forward([SequenceInput(tokens[20:], 20, too_many)])


def test_layers_with_and_without_a_window_release_nothing(tmp_path):
    """Qwen2 windows only its upper layers: attention follows each layer's, and since the
    full layers read everything, no block may be released."""
    folder = make_tiny_model("qwen2_window", tmp_path / "qwen2", max_position_embeddings=512)
    eng = engine(folder)
    assert eng.runner.sliding_window is None and eng.scheduler.sliding_window is None
    assert eng.runner.model.arch.layer_windows == (None, WINDOWS["qwen2_window"])
    (p,) = prompts(10, [15])
    want = reference_greedy(load_reference(folder), p, 30)
    assert eng.generate(p, GREEDY | {"max_new_tokens": 30}).output_ids == want


def test_triton_path_matches_torch_path_with_a_window(folder, monkeypatch):
    """The windowed forward on the Triton kernels (interpreted on CPU) as on torch's, with
    released entries in a table."""
    runner = ModelRunner(folder, num_blocks=32, block_size=BLOCK)
    a, b = prompts(11, [30, 14])
    ta, tb = list(range(8)), list(range(8, 16))
    released = [RELEASED] * dead_blocks(29, WINDOW, BLOCK) + ta[dead_blocks(29, WINDOW, BLOCK) :]
    batches = [
        [SequenceInput(a[:20], 0, ta), SequenceInput(b[:6], 0, tb)],
        [SequenceInput(a[20:29], 20, ta), SequenceInput(b[6:7], 6, tb)],
        [SequenceInput(a[29:], 29, released), SequenceInput(b[7:], 7, tb)],
    ]
    want = [runner.forward(batch).logits for batch in batches]
    monkeypatch.setenv("RADIXLANG_KERNELS", "triton")
    got = [runner.forward(batch).logits for batch in batches]
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=0)


def test_which_configs_window_which_layers():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from radixlang.runtime.models.llama import LlamaArch

    common = {"vocab_size": 8, "hidden_size": 16, "intermediate_size": 8}
    common |= {"num_hidden_layers": 3, "num_attention_heads": 2, "max_position_embeddings": 64}

    def windows(config) -> tuple:
        arch = LlamaArch.from_config(config)
        assert arch.max_context == 64  # never capped at the window
        return arch.layer_windows, arch.sliding_window

    assert windows(MistralConfig(**common, sliding_window=16)) == ((16, 16, 16), 16)
    assert windows(MistralConfig(**common, sliding_window=None)) == ((), None)
    # Qwen2 windows nothing unless use_sliding_window, then the layers from max_window_layers.
    assert windows(Qwen2Config(**common, sliding_window=16)) == ((), None)
    qwen = Qwen2Config(**common, sliding_window=16, use_sliding_window=True, max_window_layers=0)
    assert windows(qwen) == ((16, 16, 16), 16)
    qwen = Qwen2Config(**common, sliding_window=16, use_sliding_window=True, max_window_layers=2)
    assert windows(qwen) == ((None, None, 16), None)
    # transformers' Llama ignores a sliding_window in its config; so does the runner.
    assert windows(LlamaConfig(**common, sliding_window=16)) == ((), None)
