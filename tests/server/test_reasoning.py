"""Reasoning models, on a tiny random model with a thinking chat template (``<think>`` and
``</think>`` single tokens): a JSON schema holds the answer after the thinking, the thinking
budget holds, and the chat route answers the thinking as ``reasoning_content`` (whole and
streamed alike)."""

from __future__ import annotations

import itertools
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
FORMAT = {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}


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


def test_responses_answer_the_thinking_as_a_reasoning_item(client_t, thinking_engine):
    model, thought = thinking_engine.files.name, 0
    for seed in range(6):
        body = dict(model=model, input="What is 2 + 2?", max_output_tokens=80, temperature=1.0,
                    text=FORMAT, extra_body={"seed": seed, "thinking_budget": 5})  # fmt: skip
        r = client_t.responses.create(**body)
        kinds = [item.type for item in r.output]
        jsonschema.validate(json.loads(r.output_text), SCHEMA)  # the answer alone
        events = list(client_t.responses.create(**body, stream=True))
        final = events[-1].response
        assert [item.type for item in final.output] == kinds
        if kinds[0] == "reasoning":
            thought += 1
            text = r.output[0].content[0].text
            streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
            assert streamed == text == final.output[0].content[0].text
            assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 5 + 2  # <think>, </think>
        assert final.output_text == r.output_text
    assert thought > 0


def test_a_conversation_with_thinking_stays_in_the_cache(client_t, thinking_engine):
    model, previous, usage = thinking_engine.files.name, None, []
    for turn in ("Hi.", "And now?", "Bye."):
        for seed in range(20):  # a turn that thinks (the random model's own choice)
            # (a JSON answer leaves few first tokens beside <think>: the model often thinks)
            extra = {"seed": seed, "thinking_budget": 4}
            r = client_t.responses.create(model=model, input=turn, previous_response_id=previous,
                                          max_output_tokens=40, temperature=1.0, text=FORMAT,
                                          extra_body=extra)  # fmt: skip
            if r.output[0].type == "reasoning":
                break
        assert r.output[0].type == "reasoning"
        usage.append(r.usage)
        previous = r.id
    for before, now in itertools.pairwise(usage):
        # The earlier answer is rendered again as written, its thinking included, so the prompt
        # extends the last one and its thinking: all of that is cached (and the answer after
        # it, as far as its text tokenizes to the tokens the random model drew).
        thought = before.output_tokens_details.reasoning_tokens  # <think> ... </think>
        assert now.input_tokens_details.cached_tokens >= before.input_tokens + thought


def test_a_template_opened_thinking_stays_in_the_cache_too(client_t, thinking_engine):
    # chat_template_kwargs (as vLLM and SGLang take it): the template opens "<think>\n" itself.
    model, previous, usage = thinking_engine.files.name, None, []
    extra = {"thinking_budget": 4, "chat_template_kwargs": {"enable_thinking": True}}
    for seed, turn in enumerate(("Hi.", "And now?", "Bye.")):
        r = client_t.responses.create(model=model, input=turn, previous_response_id=previous,
                                      max_output_tokens=40, temperature=1.0, text=FORMAT,
                                      extra_body=extra | {"seed": seed})  # fmt: skip
        assert r.output[0].type == "reasoning"  # opened by the prompt: always
        usage.append(r.usage)
        previous = r.id
    for before, now in itertools.pairwise(usage):
        thought = before.output_tokens_details.reasoning_tokens
        assert now.input_tokens_details.cached_tokens >= before.input_tokens + thought


def test_chat_template_kwargs_cannot_set_the_servers_arguments(client_t, thinking_engine):
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        client_t.chat.completions.create(
            model=thinking_engine.files.name, messages=ASK, max_tokens=2,
            extra_body={"chat_template_kwargs": {"tokenize": True}})  # fmt: skip


def test_messages_answer_the_thinking_as_a_thinking_block(thinking_server, thinking_engine):
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="x", max_retries=0)
    model, thought = thinking_engine.files.name, 0
    for seed in range(6):
        body = dict(model=model, max_tokens=80, messages=ASK,
                    thinking={"type": "enabled", "budget_tokens": 5},
                    output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
                    extra_body={"seed": seed, "temperature": 1.0})  # fmt: skip
        m = claude.messages.create(**body)
        with claude.messages.stream(**body) as s:
            final = s.get_final_message()
        assert [b.type for b in final.content] == [b.type for b in m.content]
        jsonschema.validate(json.loads(m.content[-1].text), SCHEMA)
        if m.content[0].type == "thinking":
            thought += 1
            assert final.content[0].thinking == m.content[0].thinking
    assert thought > 0


def test_a_thinking_block_sent_back_keeps_the_conversation_cached(thinking_server,
                                                                  thinking_engine):  # fmt: skip
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=thinking_server.url, api_key="x", max_retries=0)
    body = dict(model=thinking_engine.files.name, max_tokens=60,
                thinking={"type": "enabled", "budget_tokens": 4},
                output_config={"format": {"type": "json_schema", "schema": SCHEMA}})  # fmt: skip
    for seed in range(20):
        first = claude.messages.create(**body, messages=ASK, extra_body={"seed": seed})
        if first.content[0].type == "thinking":
            break
    assert first.content[0].type == "thinking"
    history = [*ASK, {"role": "assistant", "content": first.content},
               {"role": "user", "content": "And 3 + 3?"}]  # fmt: skip
    second = claude.messages.create(**body, messages=history)
    read = second.usage.cache_read_input_tokens
    # The thinking block comes back as the model wrote it: the prompt stays on the cached path
    # through it (and into the answer, as far as its text tokenizes to the drawn tokens).
    block = f"<think>{first.content[0].thinking}</think>"
    thought = len(thinking_engine.tokenizer.encode(block, add_special_tokens=False))
    assert read >= first.usage.input_tokens + first.usage.cache_read_input_tokens + thought


def test_thinking_on_a_model_that_does_not_think_is_refused(client):
    body = {"model": "x", "max_tokens": 2, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 10}}  # fmt: skip
    r = client.post(
        "/v1/messages", json=body | {"model": client.get("/v1/models").json()["data"][0]["id"]}
    )
    assert r.status_code == 400 and "does not think" in r.json()["error"]["message"]


def test_tool_calls_come_after_the_thinking_and_are_valid(client_t, thinking_engine):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
        "required": ["zone"]}}}  # fmt: skip
    # The template opens the thinking (enable_thinking): every answer thinks, then calls.
    extra = {"thinking_budget": 4, "chat_template_kwargs": {"enable_thinking": True}}
    for seed in range(8):
        message = client_t.chat.completions.create(
            model=thinking_engine.files.name, messages=ASK, tools=[tool], tool_choice="required",
            max_tokens=60, temperature=1.0, seed=seed, extra_body=extra,
        ).choices[0].message  # fmt: skip
        assert (message.model_extra or {}).get("reasoning_content") is not None
        assert message.tool_calls  # the call block after the thinking parses
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.fixture(scope="module")
def magistral_engine(tmp_path_factory):
    """A tiny random model that thinks in Magistral's tags, [THINK] and [/THINK], special
    tokens of its tokenizer (which decoding usually drops)."""
    from transformers import AutoTokenizer

    from radixlang.runtime.engine import Engine
    from radixlang.testing import THINKING_TEMPLATE, write_tiny_chat_model

    folder = write_tiny_chat_model(tmp_path_factory.mktemp("magistral") / "m", extra_tokens=2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[THINK]", "[/THINK]"]})
    tokenizer.chat_template = THINKING_TEMPLATE.replace("<think>", "[THINK]")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer.save_pretrained(folder)
    engine = Engine(str(folder), kv_memory="64MiB", deterministic=True)
    yield engine
    engine.shutdown(free_cache=True)


def test_magistral_s_thinking_tags_are_read_and_split(magistral_engine):
    engine = magistral_engine
    markers = engine.reasoning_markers
    assert markers is not None and markers.texts == ("[THINK]", "[/THINK]") and markers.special
    prompt = _prompt(engine, thinking=False)
    sampling = [{"max_new_tokens": 80, "temperature": 1.0, "seed": seed, "json_schema": SCHEMA,
                 "thinking_budget": 5, "logit_bias": {markers.open_id: 15.0}}
                for seed in range(20)]  # fmt: skip
    thought = 0
    for result in engine.generate([prompt] * 20, sampling):
        assert result.finish_reason.value == "stop", result.text
        reasoning, answer = split_reasoning(result.text, markers=markers.texts)
        jsonschema.validate(json.loads(answer), SCHEMA)  # the thinking kept out of the answer
        thought += reasoning is not None
    assert thought >= 10
    # The chat route answers the thinking as reasoning_content.
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        message = client.chat.completions.create(
            model=engine.files.name, messages=ASK, max_tokens=80, temperature=1.0, seed=1,
            logit_bias={str(markers.open_id): 15.0}, extra_body={"thinking_budget": 5},
            response_format={"type": "json_schema", "json_schema": {"name": "a",
                                                                    "schema": SCHEMA}},
        ).choices[0].message  # fmt: skip
    assert (message.model_extra or {}).get("reasoning_content") is not None
    jsonschema.validate(json.loads(message.content), SCHEMA)
