"""A server whose engine drafts (speculative="ngram", deterministic): its answers through
/generate and the OpenAI client, whole and streamed, equal a non-drafting engine's; /metrics
counts the drafts; every KV block comes back."""

from __future__ import annotations

import json

import pytest
from server_checks import assert_no_leak, fresh_cache, metrics, wait_idle

from radixlang.runtime.engine import Engine


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    # The step cost pinned: how many tokens are drafted (counted below) follows from the
    # requests alone, not from how fast this machine runs the steps.
    eng = Engine(
        str(chat_model_dir),
        kv_memory="64MiB",
        deterministic=True,
        speculative="ngram",
        speculative_step_cost_ms=(19.0, 1.0, 0.4),
    )
    yield eng
    eng.shutdown(free_cache=True)


@pytest.fixture(scope="module")
def plain(chat_model_dir):
    """The same model, without drafts: what every answer must equal."""
    eng = Engine(str(chat_model_dir), kv_memory="64MiB", deterministic=True)
    yield eng
    eng.shutdown(free_cache=True)


PROMPT = "one two three four five one two three four five one two three"
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def _stream(client, body: dict) -> list[dict]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.compares_outputs
def test_generate_whole_and_streamed_equals_the_engine_without_drafts(client, plain):
    fresh_cache(client)
    want = plain.generate(PROMPT, GREEDY)
    before = metrics(client)
    # Twice: the second time the first answer's path in the radix cache drafts it whole.
    for _ in range(2):
        out = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()
        assert out["output_ids"] == want.output_ids and out["text"] == want.text
    chunks = _stream(client, {"text": PROMPT, "sampling_params": GREEDY})
    assert chunks[-1]["output_ids"] == want.output_ids
    assert chunks[-1]["text"] == want.text
    after = wait_idle(client)
    drafted = (
        after["radixlang_spec_draft_tokens_total"] - before["radixlang_spec_draft_tokens_total"]
    )
    accepted = (
        after["radixlang_spec_accepted_tokens_total"]
        - before["radixlang_spec_accepted_tokens_total"]
    )
    assert accepted >= 30 and drafted >= accepted
    # Fewer steps than tokens: several tokens taken in one step.
    steps = after["radixlang_engine_steps_total"] - before["radixlang_engine_steps_total"]
    assert steps < 3 * 40
    assert_no_leak(client)


@pytest.mark.compares_outputs
def test_chat_whole_and_streamed_with_logprobs_equal_the_engine_without_drafts(oai, model, plain):
    messages = [{"role": "user", "content": "Say one two three one two three one two three."}]
    kwargs = dict(model=model, messages=messages, max_tokens=30, temperature=0, logprobs=True)
    whole = oai.chat.completions.create(**kwargs)
    parts = list(oai.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert streamed == whole.choices[0].message.content
    text = plain.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = plain.generate(
        plain.tokenizer.encode(text),
        {"max_new_tokens": 30, "temperature": 0, "return_logprob": True},
    )
    assert whole.choices[0].message.content == want.text
    got = [t.logprob for t in whole.choices[0].logprobs.content]
    assert got == pytest.approx(want.output_logprobs, abs=1e-5)
