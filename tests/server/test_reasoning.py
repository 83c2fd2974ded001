"""Reasoning models, on a tiny random model with a thinking chat template (``<think>`` and
``</think>`` single tokens): a JSON schema holds the answer after the thinking, the thinking
budget holds, and the chat route answers the thinking as ``reasoning_content`` (whole and
streamed alike)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_checks import assert_no_leak

from radixlang.constrain.reasoning import ReasoningSplitter, split_reasoning

SCHEMA = {"type": "object", "properties": {"answer": {"enum": [3, 4, 5]},
                                           "word": {"type": "string", "maxLength": 6}},
          "required": ["answer", "word"]}  # fmt: skip
ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory):
    from radixlang.runtime.engine import Engine
    from radixlang.testing import write_tiny_thinking_model

    folder = write_tiny_thinking_model(tmp_path_factory.mktemp("thinking") / "model")
    engine = Engine(str(folder), kv_memory="64MiB", deterministic=True)
    yield engine
    engine.shutdown(free_cache=True)


@pytest.fixture(scope="module")
def thinking_server(thinking_engine):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(thinking_engine) as srv:
        yield srv


@pytest.fixture()
def client_t(thinking_server):
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="x", max_retries=0)


def _prompt(engine, thinking: bool) -> list[int]:
    text = engine.tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True,
                                                enable_thinking=thinking)  # fmt: skip
    return engine.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("opened", [True, False])
def test_a_json_schema_holds_the_answer_after_thinking_and_the_budget_holds(thinking_engine,
                                                                             opened):  # fmt: skip
    engine, budget = thinking_engine, 6
    markers = engine.reasoning_markers
    prompt = _prompt(engine, thinking=opened)
    sampling = [{"max_new_tokens": 80, "temperature": 1.0, "seed": seed, "json_schema": SCHEMA,
                 "thinking_budget": budget} for seed in range(50)]  # fmt: skip
    thought = 0
    for result in engine.generate([prompt] * 50, sampling):
        ids = result.output_ids
        if markers.close_id in ids:
            start = ids.index(markers.open_id) + 1 if markers.open_id in ids else 0
            assert not opened or markers.open_id not in ids  # the prompt opened it already
            assert ids.index(markers.close_id) - start <= budget  # then </think> is forced
            thought += 1
        assert result.finish_reason.value == "stop", result.text
        reasoning, answer = split_reasoning(result.text, opened)
        assert (reasoning is not None) == (markers.close_id in ids or opened)
        jsonschema.validate(json.loads(answer), SCHEMA)
    if opened:
        assert thought == 50  # every answer came after its thinking
    else:
        assert thought > 0  # the model chose to think at times (a random model, both ways)


def test_a_budget_on_a_model_that_does_not_think_is_refused(engine):
    from radixlang.runtime.request import RequestError

    with pytest.raises(RequestError, match="thinking_budget"):
        engine.submit("Hi", {"max_new_tokens": 2, "thinking_budget": 3})


def test_chat_answers_the_thinking_as_reasoning_content(client_t, thinking_engine):
    model = thinking_engine.files.name
    thought = 0
    for seed in range(8):  # sampled: the model opens a thinking block or not, its own choice
        body = dict(model=model, messages=ASK, max_tokens=80, temperature=1.0, seed=seed,
                    extra_body={"thinking_budget": 5},
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "a", "schema": SCHEMA}})  # fmt: skip
        whole = client_t.chat.completions.create(**body).choices[0].message
        reasoning = (whole.model_extra or {}).get("reasoning_content")
        jsonschema.validate(json.loads(whole.content), SCHEMA)  # the answer alone
        streamed_reasoning, streamed_content = "", ""
        for chunk in client_t.chat.completions.create(**body, stream=True):
            for c in chunk.choices:
                streamed_reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
                streamed_content += c.delta.content or ""
        assert streamed_content == whole.content  # the same seed: the same answer, split alike
        assert streamed_reasoning == (reasoning or "")
        thought += reasoning is not None
    assert thought > 0


def test_the_splitter_streams_what_the_whole_split_gives():
    texts = ["<think>\nAdd two and two.\n</think>\n\n{\"a\": 4}", "  {\"a\": 4}",
             "<think>cut inside", "<thi", "plain answer </think> not a marker here"]  # fmt: skip
    for text in texts:
        for opened in (False, True):
            whole = split_reasoning(text, opened)
            for cut in range(len(text) + 1):
                s = ReasoningSplitter(opened)
                r1, a1 = s.feed(text[:cut])
                r2, a2 = s.feed(text[cut:])
                r3, a3 = s.finish()
                assert (r1 + r2 + r3, a1 + a2 + a3) == ((whole[0] or ""), whole[1]), (text, cut)
    assert split_reasoning("<think>x</think>\n y") == ("x", "y")
    assert split_reasoning("no thinking") == (None, "no thinking")
    assert split_reasoning("x</think>y", opened=True) == ("x", "y")


def test_nothing_leaked_on_the_thinking_server(thinking_server, thinking_engine):
    with httpx.Client(base_url=thinking_server.url, timeout=60) as c:
        assert_no_leak(c)
    thinking_engine.check_integrity()


def test_a_program_reads_the_answer_and_its_reasoning(thinking_engine):
    import radixlang as sgl
    from radixlang.lang.backends.local import LocalBackend

    @sgl.function
    def ask(s):
        s += sgl.user("What is 2 + 2?")
        s += sgl.assistant(sgl.gen("a", max_tokens=80, json_schema=SCHEMA, thinking_budget=4))

    backend, thought = LocalBackend(thinking_engine), 0
    for seed in range(6):
        state = ask.run(backend=backend, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(state["a"]), SCHEMA)  # the variable is the answer
        reasoning = state.get_meta_info("a")["reasoning"]
        # The text keeps the thinking (the next gen continues from it); the variable does not.
        thinking = "" if reasoning is None else f"<think>{reasoning}</think>"
        assert state.text().endswith(f"<|im_start|>assistant\n{thinking}{state['a']}<|im_end|>\n")
        thought += reasoning is not None
    assert thought > 0
