"""Speculative decoding on the default model, on the work it is for: copying. Greedy answers
that extract fields from a document into JSON (free, and held to a JSON schema) and that
repeat a code file equal those without drafts, token for token (deterministic mode, in the
dtype ``auto`` picks), while several tokens are taken per verification."""

from __future__ import annotations

import json

import pytest

from radixlang.model_files import DEFAULT_MODEL, load_model_files
from radixlang.runtime.engine import Engine

DOCUMENT = """Invoice 2291
Customer: Maria Lopez, 14 Harbour Street, Leith
Date: 3 March 2026
Items: 12 oak chairs at 85 euros each; 2 walnut tables at 640 euros each
Total due: 2300 euros, by 31 March 2026"""

CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def spread(values):
    return max(values) - min(values)
"""

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "address": {"type": "string"},
        "date": {"type": "string"},
        "total": {"type": "string"},
    },
    "required": ["customer", "address", "date", "total"],
}


@pytest.fixture(scope="module")
def files():
    return load_model_files(DEFAULT_MODEL)


def _prompts(tokenizer) -> list[tuple[list[int], dict]]:
    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text)

    extract = f"{DOCUMENT}\n\nWrite the customer, address, date and total of this invoice as JSON."
    repeat = f"Repeat this code exactly, with mean renamed to average.\n\n{CODE}"
    greedy = {"temperature": 0, "max_new_tokens": 90}
    return [
        (chat(extract), greedy),
        (chat(extract), greedy | {"json_schema": json.dumps(SCHEMA)}),
        (chat(repeat), greedy),
    ]


def _run(files, tokenizer, speculative: str):
    eng = Engine(
        files,
        kv_memory="256MiB",
        deterministic=True,
        speculative=speculative,
        # Pinned: the tokens per verification asserted below follow from the requests alone.
        speculative_step_cost_ms=(19.0, 1.0, 0.4),
        check_integrity_every_step=True,
    )
    try:
        results = [eng.generate(prompt, params) for prompt, params in _prompts(tokenizer)]
        stats = eng.stats()
        eng.check_integrity()
        assert eng.flush_cache() is True
        assert eng.pool.num_free == eng.pool.num_blocks
        return results, stats
    finally:
        eng.shutdown()


def test_copying_answers_equal_those_without_drafts(files):
    tokenizer = files.load_tokenizer()
    want, plain = _run(files, tokenizer, "off")
    got, stats = _run(files, tokenizer, "ngram")
    for a, b in zip(got, want, strict=True):
        assert a.output_ids == b.output_ids
        assert a.finish_reason is b.finish_reason
    json.loads(got[1].text)  # the schema's answer is JSON
    assert "Maria Lopez" in got[0].text and "Maria Lopez" in got[1].text
    # With the step cost pinned these follow from the requests alone (measured at 7177ed1 on
    # a Zen 4: 1.96 tokens per verification and 132 steps against 205 in bfloat16, 1.91 and
    # 135 in float32); the bounds leave room for another CPU's arithmetic.
    assert stats["spec_tokens_per_verify"] > 1.7, stats
    assert stats["steps"] <= 0.75 * plain["steps"], (stats["steps"], plain["steps"])
