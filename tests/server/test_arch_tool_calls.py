"""Phi-3, Gemma 3, Qwen3-MoE and Mixtral served: a tiny random model of each family, with the
default model's tokenizer and a chat template in the family's shape
(``tiny_models.CHAT_TEMPLATES``), answers a chat completion offered tools with
``tool_choice: "required"`` by one valid, parsed call (Qwen3-MoE's in its template's Hermes
format)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from server_checks import assert_no_leak, chat_prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from tiny_models import make_tiny_model_with_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
                   "required": ["zone"]}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Each family's turn marker, as its template writes the user's turn.
USER_TURN = {
    "phi3": "<|user|>\n",
    "gemma3": "<start_of_turn>user\n",
    "qwen3_moe": "<|im_start|>user\n",
    "mixtral": "[INST] ",
}
MODEL_TYPES = {
    "phi3": "phi3",
    "gemma3": "gemma3_text",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}


@pytest.fixture(scope="module", params=sorted(USER_TURN))
def served(request, tmp_path_factory):
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve_in_thread

    kind = request.param
    folder = tmp_path_factory.mktemp(kind) / kind
    make_tiny_model_with_tokenizer(kind, folder, max_position_embeddings=1024)
    engine = Engine(str(folder), kv_memory="16MiB", deterministic=True)
    try:
        with serve_in_thread(engine) as server:
            yield kind, engine, server
    finally:
        engine.shutdown(free_cache=True)


def test_the_family_serves_a_required_tool_call(served):
    kind, engine, server = served
    assert engine.runner.model.arch.model_type == MODEL_TYPES[kind]
    # Qwen3's template writes its calls (Hermes blocks): the format is read off it; the other
    # templates write none, and the calls take radixlang's.
    hermes = engine.tool_format.name == "template" and "<tool_call>\n" in engine.tool_format.head
    assert hermes == (kind == "qwen3_moe")
    model = engine.files.name
    # The family's template renders the chat, the tools shown in it (in a system message, which
    # Gemma's template folds into the user's turn).
    prompt = engine.tokenizer.decode(chat_prompt_ids(engine, model, MESSAGES, TOOLS))
    assert USER_TURN[kind] in prompt and "get_weather" in prompt
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    for seed in range(2):
        out = oai.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_tokens=60, seed=seed)  # fmt: skip
        (choice,) = out.choices
        assert choice.finish_reason == "tool_calls"
        message = choice.message
        assert message.content is None and len(message.tool_calls) == 1
        (call,) = message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert_no_leak(client)
