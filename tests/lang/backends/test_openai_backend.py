"""The OpenAI backend against a scripted service (httpx.MockTransport): the request bodies in
both modes, select by echoed prompt log-probabilities, streams, chat-mode message passing and
its rules, errors; then against the radixlang server's /v1 routes."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import radixlang as sgl
from radixlang.lang.backends.openai import OpenAI, OpenAIError
from radixlang.lang.interpreter import ProgramError


class ScriptedService:
    """Answers every request with ``answer(path, body)``; every request recorded."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.headers: list[httpx.Headers] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((request.url.path, body))
        self.headers.append(request.headers)
        out = self.answer(request.url.path, body)
        if isinstance(out, httpx.Response):
            return out
        if isinstance(out, list):  # server-sent events
            lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in out]
            return httpx.Response(200, content="".join(lines).encode(),
                                  headers={"content-type": "text/event-stream"})  # fmt: skip
        return httpx.Response(200, json=out)

    def backend(self, **kwargs: Any) -> OpenAI:
        kwargs.setdefault("api_key", "sk-test")
        return OpenAI("m", base_url="http://svc/v1", transport=httpx.MockTransport(self.handle),
                      **kwargs)  # fmt: skip


def _completion(text: str, finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def _chat_completion(text: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
    }


# ---- completion mode ------------------------------------------------------------------------
def test_a_completion_gen_sends_openais_names_and_extras_only_when_set():
    service = ScriptedService(lambda path, body: _completion(" Paris", "length"))
    backend = service.backend(is_chat_model=False)

    @sgl.function
    def prog(s):
        s += "The capital of France is" + sgl.gen("a", max_tokens=5, stop="\n", seed=7)
        s += "\n" + sgl.gen("b", max_tokens=3, top_k=20, min_p=0.1, regex="[a-z]+", min_tokens=1)

    state = prog.run(backend=backend, temperature=0)
    assert state.text() == "The capital of France is Paris\n Paris"
    (path_a, a), (path_b, b) = service.requests
    assert path_a == path_b == "/v1/completions"
    assert a == {
        "model": "m",
        "prompt": "The capital of France is",
        "max_tokens": 5,
        "temperature": 0,
        "top_p": 1.0,
        "stop": ["\n"],
        "seed": 7,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "n": 1,
    }
    assert b == {
        "model": "m",
        "prompt": "The capital of France is Paris\n",
        "max_tokens": 3,
        "temperature": 0,
        "top_p": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "n": 1,
        "top_k": 20,
        "min_p": 0.1,
        "regex": "[a-z]+",
        "min_tokens": 1,
    }
    assert state.get_meta_info("a") == {
        "id": "cmpl-1",
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "finish_reason": {"type": "length"},
    }
    assert service.headers[0]["authorization"] == "Bearer sk-test"


def test_a_streamed_completion_yields_its_chunks_and_the_usage():
    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"id": "c", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    events = [chunk("He"), chunk("llo"), chunk(""), chunk("!", "stop"), usage, "[DONE]"]
    service = ScriptedService(lambda path, body: events)
    backend = service.backend(is_chat_model=False)
    out = list(backend.generate_stream("Say:", {"max_new_tokens": 4, "temperature": 0}))
    assert out == [
        ("He", {}),
        ("llo", {}),
        ("!", {}),
        ("", {"id": "c", "prompt_tokens": 4, "completion_tokens": 3,
              "finish_reason": {"type": "stop"}}),
    ]  # fmt: skip
    (_, body), = service.requests  # fmt: skip
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def _echo(texts: list[str], tokens_of: dict[str, list[tuple[str, float | None]]]) -> dict:
    """An echo answer: each text's (token, logprob) list, with cumulative text offsets."""
    choices = []
    for i, text in enumerate(texts):
        pairs = tokens_of[text]
        assert "".join(t for t, _ in pairs).removeprefix("<s>") == text
        offsets = [sum(len(t) for t, _ in pairs[:j]) for j in range(len(pairs))]
        logprobs = {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
                    "top_logprobs": None, "text_offset": offsets}  # fmt: skip
        choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": "length"})
    return {"id": "cmpl-e", "choices": choices[::-1]}  # any order: matched by index


PROMPT = "Is it so? The answer is "
ECHOED = {
    # The prompt's trailing " " merges into the choice: the boundary token is " yes"/" no".
    PROMPT + "yes": [("Is", None), (" it", -1.0), (" so?", -2.0), (" The", -1.5),
                     (" answer", -0.5), (" is", -0.2), (" yes", -0.7)],
    PROMPT + "no": [("Is", None), (" it", -1.0), (" so?", -2.0), (" The", -1.5),
                    (" answer", -0.5), (" is", -0.2), (" no", -0.4)],
    PROMPT + "not sure": [("Is", None), (" it", -1.0), (" so?", -2.0), (" The", -1.5),
                          (" answer", -0.5), (" is", -0.2), (" not", -0.3), (" sure", -0.9)],
    "yes": [("yes", None)],
    "no": [("no", None)],
    "not sure": [("not", None), (" sure", -4.0)],
}  # fmt: skip


@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
)
def test_select_is_one_echo_request_scored_from_the_first_token_past_the_prompt(method):
    service = ScriptedService(lambda path, body: _echo(body["prompt"], ECHOED))
    backend = service.backend(is_chat_model=False)
    choices = ["yes", "no", "not sure"]

    @sgl.function
    def prog(s):
        s += PROMPT + sgl.select("a", choices=choices, choices_method=method)

    state = prog.run(backend=backend)
    assert service.requests[0] == (
        "/v1/completions",
        {"model": "m", "prompt": [PROMPT + c for c in choices], "echo": True, "logprobs": 1,
         "max_tokens": 0, "temperature": 0},
    )  # fmt: skip
    meta = state.get_meta_info("a")
    assert meta["scored_from_position"] == 6
    assert meta["input_token_logprobs"] == [
        [(-0.7, None, " yes")],
        [(-0.4, None, " no")],
        [(-0.3, None, " not"), (-0.9, None, " sure")],
    ]
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-0.7, -0.4, -0.6])
    if method is sgl.unconditional_likelihood_normalized:
        assert service.requests[1][1]["prompt"] == choices
        # Given minus alone (the first token alone counts 0): -0.7, -0.4, (-0.3 + (-0.9 + 4)) / 2
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.7, -0.4, 1.4])
        assert state["a"] == "not sure"
    else:
        assert len(service.requests) == 1
        assert state["a"] == ("not sure" if method is sgl.greedy_token_selection else "no")


def test_select_finds_the_boundary_from_the_end_when_offsets_count_a_bos_text():
    # vLLM counts a BOS token's text in text_offset: the boundary is found from the text's end.
    echoed = {k: [("<s>", None), *[(t, lp or -1.0) for t, lp in v]] for k, v in ECHOED.items()}
    service = ScriptedService(lambda path, body: _echo(body["prompt"], echoed))
    decision = service.backend(is_chat_model=False).select(
        PROMPT, ["yes", "no"], 0.0, sgl.token_length_normalized
    )
    assert decision.meta_info["scored_from_position"] == 7
    assert decision.decision == "no"


# ---- chat mode ------------------------------------------------------------------------------
def test_chat_mode_sends_the_messages_before_the_open_assistant_turn():
    replies = iter(["Hello!", "Bye."])
    service = ScriptedService(lambda path, body: _chat_completion(next(replies)))
    backend = service.backend()
    assert backend.is_chat_model and backend.get_chat_template().stop_str == ()

    @sgl.function
    def chat(s):
        s += sgl.system("Be kind.")
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("r1", max_tokens=8))
        s += sgl.user("Go")
        s += sgl.assistant(sgl.gen("r2", max_tokens=4, temperature=0.5))

    state = chat.run(backend=backend)
    assert state["r1"] == "Hello!" and state["r2"] == "Bye."
    (path, first), (_, second) = service.requests
    assert path == "/v1/chat/completions"
    assert first == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "n": 1,
    }
    assert second["messages"] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Go"},
    ]
    assert second["max_tokens"] == 4 and second["temperature"] == 0.5
    assert state.messages()[-1] == {"role": "assistant", "content": "Bye."}
    assert state.get_meta_info("r1")["completion_tokens"] == 4


def test_chat_mode_streams_deltas():
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    events = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
              chunk({"content": "lo"}), chunk({}, "length"),
              {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
              "[DONE]"]  # fmt: skip
    service = ScriptedService(lambda path, body: events)

    @sgl.function
    def chat(s):
        s += sgl.user("Hi") + sgl.assistant(sgl.gen("r", max_tokens=2))

    state = chat.run(backend=service.backend(), stream=True)
    assert "".join(state.text_iter("r")) == "Hello" == state["r"]
    assert state.get_meta_info("r")["finish_reason"] == {"type": "length"}
    assert state.get_meta_info("r")["completion_tokens"] == 2
    assert service.requests[0][1]["messages"] == [{"role": "user", "content": "Hi"}]


def test_n_samples_in_chat_mode_are_separate_chat_requests():
    service = ScriptedService(lambda path, body: _chat_completion("x"))

    @sgl.function
    def chat(s):
        s += sgl.user("Hi") + sgl.assistant(sgl.gen("r", n=3, max_tokens=2))

    state = chat.run(backend=service.backend())
    assert state["r"] == ["x", "x", "x"]
    assert [p for p, _ in service.requests] == ["/v1/chat/completions"] * 3


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (lambda s: s.__iadd__("Hello " + sgl.gen("x")), "outside any role"),
        (lambda s: s.__iadd__(sgl.user(sgl.gen("x"))), "inside a 'user' turn"),
        (lambda s: s.__iadd__(sgl.user("Hi") + sgl.assistant("Sure: " + sgl.gen("x"))),
         "after 'Sure: ' in the assistant turn"),
    ],
)  # fmt: skip
def test_chat_mode_refuses_a_gen_that_does_not_open_an_assistant_turn(body, where):
    service = ScriptedService(lambda path, b: _chat_completion("x"))
    prog = sgl.function(lambda s: body(s))
    with pytest.raises(ProgramError, match="chat services generate whole assistant messages") as e:
        prog.run(backend=service.backend())
    assert where in str(e.value)
    assert service.requests == []


def test_select_in_chat_mode_says_why_it_cannot():
    service = ScriptedService(lambda path, b: _chat_completion("x"))

    @sgl.function
    def prog(s):
        s += sgl.user("Yes or no?")
        s += sgl.assistant(sgl.select("a", choices=["yes", "no"]))

    with pytest.raises(NotImplementedError, match="no log-probabilities for given text"):
        prog.run(backend=service.backend())


# ---- structured output ----------------------------------------------------------------------
JSON_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
               "address": {"type": "object", "properties": {"zip": {"type": "string"}}}},
               "required": ["city"]}  # fmt: skip


def test_json_schema_in_chat_mode_is_a_strict_response_format():
    service = ScriptedService(lambda path, body: _chat_completion('{"city": "Oslo"}'))

    @sgl.function
    def prog(s):
        s += sgl.user("Where?")
        s += sgl.assistant(sgl.gen("where", json_schema=JSON_SCHEMA, max_tokens=16))

    state = prog.run(backend=service.backend())
    assert state.parsed("where") == {"city": "Oslo"}
    (_, body), = service.requests  # fmt: skip
    closed = {**JSON_SCHEMA, "additionalProperties": False}
    closed["properties"] = {**JSON_SCHEMA["properties"]}
    closed["properties"]["address"] = {**JSON_SCHEMA["properties"]["address"],
                                       "additionalProperties": False}  # fmt: skip
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": closed, "strict": True},
    }
    assert "json_schema" not in body and "regex" not in body


def test_structured_extras_on_a_compatible_service_and_what_openai_itself_refuses():
    service = ScriptedService(lambda path, body: _completion("{}"))

    @sgl.function
    def completion(s, kind, value):
        s += "X" + sgl.gen("x", max_tokens=4, **{kind: value})

    compatible = service.backend(is_chat_model=False)
    completion.run(kind="json_schema", value=JSON_SCHEMA, backend=compatible)
    completion.run(kind="ebnf", value='root ::= "a"', backend=compatible)
    sent = [body for _, body in service.requests]
    assert sent[0]["json_schema"] == json.dumps(JSON_SCHEMA)  # SGLang's completions extra
    assert sent[1]["ebnf"] == 'root ::= "a"'
    with pytest.raises(NotImplementedError, match="Lark grammar"):
        completion.run(kind="grammar", value='start: "a"', backend=compatible)

    official = OpenAI("m", api_key="sk", is_chat_model=False,
                      transport=httpx.MockTransport(service.handle))  # fmt: skip
    for kind, value in (("regex", "[a-z]+"), ("ebnf", 'root ::= "a"'), ("dtype", int)):
        with pytest.raises(NotImplementedError, match="OpenAI does not support"):
            completion.run(kind=kind, value=value, backend=official)
    with pytest.raises(NotImplementedError, match="completions API does not support json_schema"):
        completion.run(kind="json_schema", value=JSON_SCHEMA, backend=official)
    assert len(service.requests) == 2  # nothing was sent for the refused gens


# ---- errors and keys --------------------------------------------------------------------------
def test_a_service_error_becomes_an_openai_error_with_status_and_message():
    error = {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                       "param": None, "code": "invalid_api_key"}}  # fmt: skip
    service = ScriptedService(lambda path, body: httpx.Response(401, json=error))

    @sgl.function
    def prog(s):
        s += sgl.user("Hi") + sgl.assistant(sgl.gen("r"))

    with pytest.raises(OpenAIError, match="Incorrect API key provided") as info:
        prog.run(backend=service.backend())
    assert isinstance(info.value, RuntimeError)
    assert info.value.status_code == 401 and info.value.error_type == "invalid_request_error"


def test_the_key_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    service = ScriptedService(lambda path, body: _chat_completion("x"))
    backend = OpenAI("m", base_url="http://svc/v1/", transport=httpx.MockTransport(service.handle))
    backend.generate_chat([{"role": "user", "content": "Hi"}], {})
    assert service.headers[0]["authorization"] == "Bearer sk-env"
    assert service.requests[0][0] == "/v1/chat/completions"
    backend.shutdown()
    assert backend.client.is_closed


def test_an_unreachable_service_is_named_in_the_error():
    backend = OpenAI("m", base_url="http://127.0.0.1:1/v1", api_key="k", is_chat_model=False,
                     timeout=5)  # fmt: skip
    with pytest.raises(OpenAIError, match=r"cannot reach .* at http://127\.0\.0\.1:1/v1"):
        backend.generate("Hi", {"max_new_tokens": 1})


# ---- against the real radixlang server's /v1 ------------------------------------------------
def _served(server, **kwargs: Any) -> OpenAI:
    name = httpx.get(server.url + "/get_model_info").json()["served_model_name"]
    return OpenAI(name, base_url=server.url + "/v1", api_key="none", **kwargs)


@pytest.mark.compares_outputs
def test_completion_mode_gives_the_local_backends_greedy_text(server, local):
    @sgl.function
    def plain(s):
        s += "The capital of France is" + sgl.gen("x", max_tokens=10)
        s += "\nAnd of Spain:" + sgl.gen("y", max_tokens=6, stop=".")

    backend = _served(server, is_chat_model=False)
    remote = plain.run(backend=backend, temperature=0)
    here = plain.run(backend=local, temperature=0)
    assert remote["x"] == here["x"] and remote["y"] == here["y"]
    assert remote.text() == here.text()
    meta, local_meta = remote.get_meta_info("x"), here.get_meta_info("x")
    assert meta["prompt_tokens"] == local_meta["prompt_tokens"]
    assert meta["completion_tokens"] == local_meta["completion_tokens"]
    assert meta["finish_reason"]["type"] == local_meta["finish_reason"]["type"]
    streamed = plain.run(backend=backend, temperature=0, stream=True)
    assert "".join(streamed.text_iter()) == here.text()


@pytest.mark.compares_outputs
@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
)
@pytest.mark.parametrize(
    ("prompt", "choices"),
    [("Question: is water wet?\nAnswer:", [" yes", " no", " it depends on the context"]),
     ("The answer is ", ["yes", "no"])],
)  # fmt: skip
def test_completion_mode_select_scores_as_the_local_backend(server, local, method, prompt, choices):
    @sgl.function
    def pick(s):
        s += prompt + sgl.select("a", choices=choices, choices_method=method)

    remote = pick.run(backend=_served(server, is_chat_model=False))
    here = pick.run(backend=local)
    meta, local_meta = remote.get_meta_info("a"), here.get_meta_info("a")
    assert remote["a"] == here["a"]
    assert meta["scored_from_position"] == local_meta["scored_from_position"]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(
        local_meta["normalized_prompt_logprobs"], abs=1e-4
    )


@pytest.mark.compares_outputs
def test_chat_mode_gives_the_servers_chat_completion(server, local):
    import openai

    @sgl.function
    def chat(s):
        s += sgl.user("Hi there, who are you?")
        s += sgl.assistant(sgl.gen("r", max_tokens=12))

    backend = _served(server)
    state = chat.run(backend=backend, temperature=0)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    reference = client.chat.completions.create(
        model=backend.model,
        messages=[{"role": "user", "content": "Hi there, who are you?"}],
        max_tokens=12,
        temperature=0,
    )
    assert state["r"] == reference.choices[0].message.content
    assert state.messages() == [
        {"role": "user", "content": "Hi there, who are you?"},
        {"role": "assistant", "content": state["r"].lstrip()},
    ]
    # The server renders the same chat template the local backend writes: same tokens.
    assert chat.run(backend=local, temperature=0)["r"] == state["r"]
    streamed = chat.run(backend=backend, temperature=0, stream=True)
    assert "".join(streamed.text_iter("r")) == state["r"]
    assert streamed.get_meta_info("r")["completion_tokens"] == reference.usage.completion_tokens


def test_the_openai_backend_sends_the_programs_routing_key_too():
    """Every HTTP backend's client carries the running program's key (lang/routing.py)."""
    from radixlang.lang.backends.http_client import make_client
    from radixlang.lang.routing import routing_scope

    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("x-routing-key"))
        return httpx.Response(200, json={})

    client = make_client("http://server", None, 5, httpx.MockTransport(handle))
    client.get("/a")
    with routing_scope("program-1"):
        client.get("/b")
    assert seen == [None, "program-1"]
