"""The OpenAI API on a real server, driven with the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest
from server_checks import assert_no_leak, fresh_cache


def test_models(oai, model, engine):
    (card,) = oai.models.list().data
    assert card.id == model and card.owned_by == "radixlang"


@pytest.mark.compares_outputs
def test_completion_matches_the_engine(oai, model, engine):
    out = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=10,
                                 temperature=0)  # fmt: skip
    alone = engine.generate("Once upon a time", {"max_new_tokens": 10, "temperature": 0})
    (choice,) = out.choices
    assert choice.text == alone.text and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(alone.prompt_ids)
    assert out.usage.completion_tokens == 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + 10


@pytest.mark.compares_outputs
def test_completion_batch_n_seed_and_logprobs(oai, model):
    out = oai.completions.create(model=model, prompt=["red", "green"], max_tokens=5, n=2,
                                 seed=3, temperature=1.0, logprobs=2)  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    again = oai.completions.create(model=model, prompt=["red", "green"], max_tokens=5, n=2,
                                   seed=3, temperature=1.0, logprobs=2)  # fmt: skip
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == 5
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) == 2 for top in lp.top_logprobs)
        assert lp.text_offset == sorted(lp.text_offset)


def test_completion_echo_scores_the_prompt(oai, model):
    out = oai.completions.create(model=model, prompt="The cat sat", max_tokens=0, echo=True,
                                 logprobs=0, temperature=0)  # fmt: skip
    (choice,) = out.choices
    assert choice.text == "The cat sat"
    assert choice.logprobs.token_logprobs[0] is None
    assert all(x < 0 for x in choice.logprobs.token_logprobs[1:])
    assert "".join(choice.logprobs.tokens) == "The cat sat"


@pytest.mark.compares_outputs
def test_completion_stream_equals_non_stream(oai, model):
    kwargs = dict(model=model, prompt="Streaming is", max_tokens=12, temperature=0)
    whole = oai.completions.create(**kwargs).choices[0]
    pieces, finish, usage = [], None, None
    for chunk in oai.completions.create(**kwargs, stream=True,
                                        stream_options={"include_usage": True}):  # fmt: skip
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole.text and finish == whole.finish_reason
    assert usage.completion_tokens == 12


@pytest.mark.compares_outputs
def test_chat_matches_the_chat_template(oai, model, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = oai.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                      temperature=0)  # fmt: skip
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)  # fmt: skip
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    alone = engine.generate(ids, {"max_new_tokens": 8, "temperature": 0})
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content == alone.text
    assert out.usage.prompt_tokens == len(ids)


@pytest.mark.compares_outputs
def test_chat_content_parts_and_developer_role(oai, model):
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    a = oai.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=developer)
    b = oai.chat.completions.create(model=model, max_tokens=6, temperature=0, messages=system)
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.compares_outputs
def test_chat_stream_equals_non_stream_with_stop_and_logprobs(oai, model):
    messages = [{"role": "user", "content": "Tell me a story."}]
    plain = oai.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                        temperature=0).choices[0].message.content  # fmt: skip
    stop = plain[4:7]
    kwargs = dict(model=model, messages=messages, max_tokens=16, temperature=0, stop=[stop],
                  logprobs=True, top_logprobs=2)  # fmt: skip
    whole = oai.chat.completions.create(**kwargs).choices[0]
    assert whole.message.content == plain[: plain.index(stop)]
    assert whole.finish_reason == "stop"
    assert all(len(t.top_logprobs) == 2 for t in whole.logprobs.content)
    text, finish, roles = "", None, []
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert roles == ["assistant"] and text == whole.message.content and finish == "stop"


@pytest.mark.compares_outputs
def test_chat_n_and_seed(oai, model):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "A word?"}], max_tokens=4,
                  temperature=1.0, n=3, seed=11)  # fmt: skip
    first = [c.message.content for c in oai.chat.completions.create(**kwargs).choices]
    second = [c.message.content for c in oai.chat.completions.create(**kwargs).choices]
    assert first == second and len(set(first)) > 1


@pytest.mark.parametrize(
    ("call", "error", "param"),
    [
        (lambda o, m: o.completions.create(model="gpt-4", prompt="x"), openai.NotFoundError,
         "model"),
        (lambda o, m: o.completions.create(model=m, prompt="x", max_tokens=-1),
         openai.BadRequestError, "max_tokens"),
        (lambda o, m: o.completions.create(model=m, prompt="x", temperature=-0.5),
         openai.BadRequestError, "temperature"),
        (lambda o, m: o.chat.completions.create(model=m, messages=[]), openai.BadRequestError,
         "messages"),
        (lambda o, m: o.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "x"}], top_logprobs=2),
         openai.BadRequestError, "top_logprobs"),
        (lambda o, m: o.completions.create(model=m, prompt="x" * 6000),
         openai.BadRequestError, "prompt"),
    ],
)  # fmt: skip
def test_openai_client_errors(oai, model, client, call, error, param):
    with pytest.raises(error) as info:
        call(oai, model)
    assert info.value.body["param"] == param
    assert info.value.body["message"]
    assert_no_leak(client)


@pytest.mark.compares_outputs
def test_logit_bias_forces_and_bans_tokens(oai, model, engine, client):
    token = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = oai.completions.create(model=model, prompt="I like", max_tokens=3, temperature=0,
                                    logit_bias={str(token): 100})  # fmt: skip
    assert forced.choices[0].text == " banana" * 3
    plain = oai.completions.create(model=model, prompt="I like", max_tokens=1, temperature=0)
    first = engine.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = oai.completions.create(model=model, prompt="I like", max_tokens=1, temperature=0,
                                    logit_bias={str(first): -100})  # fmt: skip
    assert banned.choices[0].text != plain.choices[0].text
    native = client.post("/generate", json={"text": "I like", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "logit_bias": {str(token): 100}}})  # fmt: skip
    assert native.json()["text"] == " banana" * 2


@pytest.mark.compares_outputs
def test_beam_search_through_the_openai_client(oai, model, engine):
    params = {"max_new_tokens": 8, "temperature": 0, "beam_width": 3, "length_penalty": 0.5}
    alone = engine.generate("The best way to", params)
    assert len(alone.beams) == 3
    out = oai.completions.create(model=model, prompt="The best way to", max_tokens=8,
                                 extra_body={"beam_width": 3, "length_penalty": 0.5})  # fmt: skip
    assert out.choices[0].text == alone.text  # the best beam; temperature 0 by default
    with pytest.raises(openai.BadRequestError, match="beam_width"):
        oai.completions.create(model=model, prompt="x", max_tokens=4, n=2,
                               extra_body={"beam_width": 2})  # fmt: skip


def test_cache_salt_as_an_extra_body_field(oai, model, client):
    fresh_cache(client)
    prompt = "A long salted system prompt for OpenAI clients: " + "theta iota " * 20
    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "Hi"}]

    def completion_cached(salt: str | None) -> int:
        extra = None if salt is None else {"cache_salt": salt}
        out = oai.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                     extra_body=extra)  # fmt: skip
        return out.usage.prompt_tokens_details.cached_tokens

    def chat_cached(salt: str) -> int:
        extra = {"cache_salt": salt}
        out = oai.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                          temperature=0, extra_body=extra)  # fmt: skip
        return out.usage.prompt_tokens_details.cached_tokens

    assert completion_cached("one") == 0
    assert completion_cached("one") > 20
    assert completion_cached("two") == 0
    assert completion_cached(None) == 0
    assert chat_cached("three") == 0
    assert chat_cached("three") > 20
    assert chat_cached("four") == 0
    with pytest.raises(openai.BadRequestError) as refused:
        completion_cached("x" * 300)
    assert refused.value.body["param"] == "cache_salt"
