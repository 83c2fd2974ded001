"""The engine on the default model (float32): greedy outputs equal transformers' ``generate``
token for token, prefix reuse is exact, and a shared prefix is computed once."""

from __future__ import annotations

import random

import pytest
import torch

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime.engine import Engine

QUESTIONS = [
    "What is 2+2?",
    "Name three colors.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "What does a radix tree store?",
    "Translate 'good morning' into Spanish.",
    "List two prime numbers.",
    "Why is the sky blue?",
    "Give me a name for a cat.",
    "What is Python used for?",
    "Say hello.",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Suggest a title for a short story about a robot.",
    "def add(a, b):",
]
MAX_NEW = 24
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}


@pytest.fixture(scope="module")
def files():
    return load_model_files(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def tokenizer(files):
    return files.load_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    out = []
    for i, q in enumerate(QUESTIONS):
        if i % 4 == 3:  # some plain completions, the rest chat turns
            out.append(tokenizer.encode(q))
            continue
        messages = [{"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text))
    return out


@pytest.fixture(scope="module")
def expected(files, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        files.path, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    ).eval()
    # One left-padded batch (4x faster than a generate per prompt, and the same tokens: checked
    # once against one prompt at a time); generate pads a row after its EOS, cut there.
    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    want = []
    for row in out[:, width:].tolist():
        want.append(row[: row.index(2) + 1] if 2 in row else row)
    return want


@pytest.fixture(scope="module")
def engine(files):
    # float32: the reference is float32 transformers ("auto" may pick bfloat16).
    eng = Engine(files, kv_memory="256MiB", dtype="float32", check_integrity_every_step=True)
    yield eng
    eng.shutdown()


def test_greedy_one_by_one_equals_transformers(engine, prompts, expected):
    engine.flush_cache()
    got = [engine.generate(p, GREEDY).output_ids for p in prompts]
    assert got == expected


def test_greedy_all_together_equals_transformers(engine, prompts, expected):
    engine.flush_cache()
    got = engine.generate(prompts, GREEDY)
    assert [r.output_ids for r in got] == expected
    assert engine.stats()["cache_hit_rate"] > 0  # the chat template's prefix was shared


def test_greedy_mixed_with_requests_arriving_mid_decode(engine, prompts, expected):
    engine.flush_cache()
    rng = random.Random(0)
    first = [engine.submit(p, GREEDY) for p in prompts[:8]]
    for event in first[0]:  # wait until the first batch is decoding
        if len(event.token_ids) and rng.random() < 0.5:
            break
    noise = [
        engine.submit(prompts[i] + [28, 29], {"temperature": 0.8, "max_new_tokens": 16, "seed": i})
        for i in range(3)
    ]
    rest = [engine.submit(p, GREEDY) for p in prompts[8:]]
    assert [h.result().output_ids for h in first + rest] == expected
    assert all(h.result().completion_tokens > 0 for h in noise)
    engine.check_integrity()


@pytest.mark.parametrize("shared", [48, 53])  # a prefix ending on and inside a 16-token block
def test_reused_prefix_is_exact(files, engine, prompts, shared):
    long = prompts[4] + prompts[5] + prompts[6]
    prefix = long[:shared]
    first, second = prefix + prompts[7], prefix + prompts[8]
    params = {
        "temperature": 0,
        "max_new_tokens": 6,
        "return_logprob": True,
        "top_logprobs_num": 10,
        "logprob_start_len": shared + 1,
    }
    engine.flush_cache()
    engine.generate(first, params)
    hit = engine.generate(second, params)
    assert hit.cached_tokens == shared
    engine.flush_cache()
    fresh = engine.generate(second, params)
    assert fresh.cached_tokens == 0
    assert hit.output_ids == fresh.output_ids
    pairs = list(zip(hit.prompt_logprobs, fresh.prompt_logprobs, strict=True))
    assert len(pairs) == len(second) - shared - 1
    assert max(abs(a[1] - b[1]) for a, b in pairs) < 2e-4
    diffs = [
        abs(x - y)
        for a, b in zip(hit.output_top_logprobs, fresh.output_top_logprobs, strict=True)
        for (_, x), (_, y) in zip(a, b, strict=True)
    ]
    assert max(diffs) < 2e-4


def test_shared_400_token_prefix_is_computed_once(engine, tokenizer):
    rng = random.Random(1)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "kappa",
        "lambda",
        "sigma",
        "omega",
        "radix",
        "block",
        "cache",
        "token",
    ]
    document = " ".join(rng.choice(words) for _ in range(400))
    prefix = tokenizer.encode(document)[:400]
    prompts = [
        prefix + tokenizer.encode(f" Question {i}: what is item {i * 7}?") for i in range(32)
    ]
    engine.flush_cache()
    before = engine.stats()
    engine.generate(prompts, {"temperature": 0, "max_new_tokens": 4})
    after = engine.stats()
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    reused = after["prompt_tokens_reused"] - before["prompt_tokens_reused"]
    trie = len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})
    assert computed <= trie + len(prompts)
    assert computed + reused == sum(map(len, prompts))
    assert reused >= 31 * 400


def test_stop_strings_are_cut_across_tokens_and_never_streamed(engine, tokenizer, prompts):
    free = engine.generate(prompts[2], {"temperature": 0, "max_new_tokens": 24})
    text = free.text
    assert len(text) > 12
    stop = text[5:9]  # four characters that need not fall on token boundaries
    first = text.index(stop)
    handle = engine.submit(prompts[2], {"temperature": 0, "max_new_tokens": 24, "stop": [stop]})
    streamed = "".join(event.text for event in handle)
    result = handle.result()
    assert result.text == streamed == text[:first]
    assert result.finish_reason.value == "stop" and result.matched_stop == stop
    # the tokens that made up the stop string were generated, then the request ended
    assert tokenizer.decode(result.output_ids).startswith(text[: first + len(stop)])
