"""OpenAI's Responses API with the official ``openai`` client: plain, streamed (its typed
events in order), a function tool round trip, ``text.format`` JSON schema, a conversation
continued by ``previous_response_id`` from the cache, GET and DELETE, per-tenant storage, and
refusals in OpenAI's error shape naming the field."""

from __future__ import annotations

import itertools
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response
from server_checks import assert_no_leak, chat_prompt_ids

from radixlang.server.response_store import ResponseStore, StoredResponse

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"]}}  # fmt: skip
TIME = {"type": "function", "name": "get_time", "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                       "required": ["zone"]}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                           "score": {"type": "integer"}},
          "required": ["answer", "score"]}  # fmt: skip


def test_a_plain_response_has_one_message_and_usage(oai, model):
    r = oai.responses.create(model=model, input="Say hi.", max_output_tokens=8, temperature=0)
    assert isinstance(r, Response) and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.model == model
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert item.content[0].type == "output_text" and r.output_text == item.content[0].text
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_items_are_the_chat_the_template_renders(oai, model, engine):
    r = oai.responses.create(
        model=model, instructions="Be brief.", temperature=0, max_output_tokens=6,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
    )  # fmt: skip
    chat = oai.chat.completions.create(
        model=model, temperature=0, max_tokens=6,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    )  # fmt: skip
    assert r.output_text == chat.choices[0].message.content  # the same prompt, greedy
    assert r.instructions == "Be brief."


def test_streamed_events_come_in_order_and_add_up_to_the_response(oai, model):
    events = list(oai.responses.create(model=model, input="Count: one, two,", stream=True,
                                       max_output_tokens=10, temperature=0))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    body = [k for k in kinds[2:-1] if k != "response.output_text.delta"]
    assert body == ["response.output_item.added", "response.content_part.added",
                    "response.output_text.done", "response.content_part.done",
                    "response.output_item.done"]  # fmt: skip
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.output[0].id == events[2].item.id
    plain = oai.responses.create(model=model, input="Count: one, two,", max_output_tokens=10,
                                 temperature=0)  # fmt: skip
    assert plain.output_text == text


def test_a_function_tool_round_trip(oai, model):
    r = oai.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER],
                             tool_choice="required", temperature=0)  # fmt: skip
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The tool's result goes back as a function_call_output, continuing the stored response.
    follow = oai.responses.create(
        model=model, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temp": 21}'}],
    )  # fmt: skip
    assert follow.previous_response_id == r.id and follow.output
    assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    # The same, stateless: the call and its output sent back as input items.
    again = oai.responses.create(
        model=model, tools=[WEATHER], max_output_tokens=8,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"temp": 21}'}],
    )  # fmt: skip
    assert again.output


def test_a_function_call_output_is_in_the_prompt_the_next_turn_counts(oai, model, engine):
    """The output sent back reaches the prompt: ``usage.input_tokens`` is the length of the
    prompt the server renders for the chat with the output in its tool message, and grows by
    the output's own tokens."""
    arguments = '{"city": "Paris", "unit": "c"}'
    short = "RESULT-7f3a"
    long = "RESULT-7f3a: 21 degrees, clear sky over the river, wind from the west at 9 km/h"

    def input_tokens(output: str) -> int:
        r = oai.responses.create(
            model=model, tools=[WEATHER], max_output_tokens=1, temperature=0,
            input=[{"role": "user", "content": "Weather in Paris?"},
                   {"type": "function_call", "call_id": "call_7f3a", "name": "get_weather",
                    "arguments": arguments},
                   {"type": "function_call_output", "call_id": "call_7f3a", "output": output}],
        )  # fmt: skip
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        return r.usage.input_tokens

    def rendered(output: str) -> list[int]:
        tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_7f3a", "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_7f3a", "content": output},
        ]  # fmt: skip
        return chat_prompt_ids(engine, model, messages, [tool])

    assert f"<|im_start|>tool\n{short}<|im_end|>" in engine.tokenizer.decode(rendered(short))
    for output in (short, long):
        assert input_tokens(output) == len(rendered(output)), output

    def n_tokens(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    grown = n_tokens(long) - n_tokens(short)
    assert grown > 0 and input_tokens(long) - input_tokens(short) == grown
    assert input_tokens("") < input_tokens(short)


def test_a_named_function_call_streams_its_arguments(oai, model):
    events = list(oai.responses.create(
        model=model, input="Time?", tools=[WEATHER, TIME], stream=True,
        tool_choice={"type": "function", "name": "get_time"}, temperature=0))  # fmt: skip
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added and added[0].item.type == "function_call" and added[0].item.name == "get_time"
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")  # fmt: skip
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == arguments
    jsonschema.validate(json.loads(arguments), TIME["parameters"])
    final = events[-1].response
    assert final.output[0].arguments == arguments


def test_text_format_json_schema_is_held(oai, model):
    for seed in range(3):
        r = oai.responses.create(
            model=model, input="Rate this.", temperature=1.0, extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "rating", "schema": SCHEMA,
                             "strict": True}},
        )  # fmt: skip
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        assert r.text.format.type == "json_schema"


def test_a_three_turn_conversation_is_computed_from_the_cache(oai, model):
    # An agent's instructions (a few hundred tokens), then three short turns.
    rules = " ".join(f"Rule {i}: answer briefly and politely." for i in range(30))
    previous, usage = None, []
    for turn in ("Hi, I am Ann.", "What is my name?", "Thanks, and bye."):
        r = oai.responses.create(model=model, input=turn, previous_response_id=previous,
                                 instructions=rules, max_output_tokens=12,
                                 temperature=0)  # fmt: skip
        usage.append(r.usage)
        previous = r.id
    for before, now in itertools.pairwise(usage):
        cached = now.input_tokens_details.cached_tokens
        assert cached >= 0.9 * now.input_tokens, usage  # only the new turn is computed
        # All of the earlier turn is reused: its prompt and its answer (but the answer's last
        # token, whose KV its decoding never computed).
        assert cached >= before.input_tokens + before.output_tokens - 1, usage


def test_get_and_delete_a_stored_response(oai, model):
    r = oai.responses.create(model=model, input="Hi", max_output_tokens=3)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=model, input="Hi", previous_response_id=r.id)
    unstored = oai.responses.create(model=model, input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"background": True}, "background"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"temperature": 3}, "temperature"),
    ],
)  # fmt: skip
def test_unsupported_and_malformed_requests_are_refused_naming_the_field(client, model, extra,
                                                                         param):  # fmt: skip
    body = {"model": model, "input": "Hi", "max_output_tokens": 2} | extra
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_unknown_model_is_a_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input="Hi")


def test_stored_responses_belong_to_their_tenant_and_are_bounded():
    store = ResponseStore(max_responses=2, max_age_s=60)
    for i in range(3):
        store.put(f"r{i}", StoredResponse("ann", [], {"id": f"r{i}"}))
    assert store.get("r0", "ann") is None and len(store) == 2  # the oldest went
    assert store.get("r2", "ann") is not None and store.get("r2", "bob") is None
    assert not store.delete("r2", "bob") and store.delete("r2", "ann")


def test_with_tenants_a_response_is_its_tenants_only(engine):
    from radixlang.server.app import serve_in_thread

    keys = {"key-ann": "ann", "key-bob": "bob"}
    with serve_in_thread(engine, api_keys=keys) as srv:
        ann = openai.OpenAI(base_url=srv.url + "/v1", api_key="key-ann", max_retries=0)
        bob = openai.OpenAI(base_url=srv.url + "/v1", api_key="key-bob", max_retries=0)
        r = ann.responses.create(model=engine.files.name, input="Hi", max_output_tokens=2)
        assert ann.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=engine.files.name, input="Hi", previous_response_id=r.id)


def test_nothing_leaked_and_the_engine_is_intact(client, engine):
    assert_no_leak(client)
    engine.check_integrity()


def test_the_stream_is_typed_events_without_done(server, model):
    body = {"model": model, "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        text = c.post("/v1/responses", json=body).text
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("event: response.") for e in events), text[:300]
    assert "[DONE]" not in text


def test_a_malformed_response_id_is_a_400_naming_it(client):
    r = client.get("/v1/responses/not-an-id")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    assert client.delete("/v1/responses/resp_" + "0" * 32).status_code == 404
