"""RuntimeEndpoint against a scripted server (httpx.MockTransport): the exact requests it sends
(a fork's prefill-only request first, select's one batched log-probability request), how it
scores choices from where their tokenizations depart, the cumulative stream, errors."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest
from engine_gate import hold_steps  # tests/, on the path through tests/conftest.py

import radixlang as sgl
from radixlang.lang.backends.endpoint import EndpointError, RuntimeEndpoint
from radixlang.lang.chat_template import PLAIN, ChatTemplate

CHATML_JINJA = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MODEL_INFO = {"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True}


def _tokenize(text: str) -> list[str]:
    """A word-level stand-in for BPE: a space joins the word after it, so "is " + "yes"
    retokenizes the prompt's trailing " " as part of " yes"."""
    return re.findall(r" ?[^ ]+| ", text)


def _logprob(pos: int, token: str) -> float:
    return -0.25 * len(token) - 0.01 * pos


class ScriptedServer:
    """SGLang's native API over the stand-in tokenizer; every request recorded."""

    def __init__(self, model_info: dict[str, Any] | None = None, reply: str = "ok") -> None:
        self.model_info = model_info or MODEL_INFO
        self.reply = reply
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, json body)
        self.vocab: dict[str, int] = {}
        self.tokenize = _tokenize

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def generate_bodies(self) -> list[dict[str, Any]]:
        return [body for _, path, body in self.requests if path == "/generate"]

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json=self.model_info)
        if request.url.path == "/generate":
            if isinstance(body["text"], list):
                return httpx.Response(200, json=[self._one(t, body) for t in body["text"]])
            return httpx.Response(200, json=self._one(body["text"], body))
        return httpx.Response(404, json={"error": {"message": "not found", "code": 404}})

    def _one(self, text: str, body: dict[str, Any]) -> dict[str, Any]:
        tokens = self.tokenize(text)
        ids = [self.vocab.setdefault(t, len(self.vocab) + 3) for t in tokens]
        out_text = self.reply if body["sampling_params"].get("max_new_tokens") != 0 else ""
        meta: dict[str, Any] = {
            "id": "r1",
            "prompt_tokens": len(ids),
            "completion_tokens": len(out_text and [out_text]),
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 1},
            "e2e_latency": 0.001,
        }
        if body.get("return_logprob"):
            start = body.get("logprob_start_len", -1)
            meta["input_token_logprobs"] = [
                [None if p == 0 else _logprob(p, tokens[p]), ids[p], tokens[p]]
                for p in range(max(start, 0), len(ids))
            ] if start >= 0 else []  # fmt: skip
            meta["output_token_logprobs"] = [[-0.5, 99, out_text]] if out_text else []
        return {"text": out_text, "output_ids": [99] if out_text else [], "meta_info": meta}


def _endpoint(server: ScriptedServer, **kwargs: Any) -> RuntimeEndpoint:
    return RuntimeEndpoint("http://server:30000", transport=server.transport(), **kwargs)


# ---- model info and the chat template ---------------------------------------------------------
def test_the_chat_template_comes_from_the_servers_jinja_template():
    server = ScriptedServer(
        {**MODEL_INFO, "chat_template": CHATML_JINJA, "eos_token": "<|im_end|>"}
    )
    backend = _endpoint(server)
    template = backend.get_chat_template()
    assert template.prefix["user"] == "<|im_start|>user\n"
    assert template.suffix["assistant"] == "<|im_end|>\n"
    assert template.stop_str == ("<|im_end|>",)
    assert server.requests[0][:2] == ("GET", "/get_model_info")


def test_an_sglang_server_without_a_template_gives_plain_and_an_argument_overrides():
    assert _endpoint(ScriptedServer()).get_chat_template() is PLAIN
    mine = ChatTemplate(name="mine", prefix=PLAIN.prefix, suffix=PLAIN.suffix)
    server = ScriptedServer({**MODEL_INFO, "chat_template": CHATML_JINJA})
    assert _endpoint(server, chat_template=mine).get_chat_template() is mine


# ---- generate -------------------------------------------------------------------------------
def test_gen_sends_the_sampling_params_and_lifts_the_logprob_fields_to_the_top():
    server = ScriptedServer(reply=" there")

    @sgl.function
    def prog(s):
        s += "Hello"
        s += sgl.gen("x", max_tokens=5, temperature=0, stop="\n", top_k=4, return_logprob=True)

    state = prog.run(backend=_endpoint(server))
    assert state["x"] == " there"
    assert state.text() == "Hello there"
    (body,) = server.generate_bodies()
    assert body == {
        "text": "Hello",
        "sampling_params": {
            "max_new_tokens": 5,
            "min_new_tokens": 0,
            "stop": ["\n"],
            "stop_token_ids": [],
            "temperature": 0,
            "top_p": 1.0,
            "top_k": 4,
            "min_p": 0.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "ignore_eos": False,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
    }
    meta = state.get_meta_info("x")
    assert meta["output_ids"] == [99]
    assert meta["output_token_logprobs"] == [(-0.5, 99, " there")]  # JSON lists as triples
    assert meta["finish_reason"] == {"type": "length", "length": 1}


def test_fork_first_sends_a_prefill_only_request_for_the_shared_prefix():
    server = ScriptedServer()

    @sgl.function
    def prog(s):
        s += "Shared question."
        forks = s.fork(3)
        forks += lambda i: f" Branch {i}:" + sgl.gen("x", max_tokens=2)
        forks.join()

    state = prog.run(backend=_endpoint(server))
    assert state["x"] == ["ok"] * 3
    bodies = server.generate_bodies()
    assert bodies[0] == {"text": "Shared question.", "sampling_params": {"max_new_tokens": 0}}
    assert sorted(b["text"] for b in bodies[1:]) == [
        f"Shared question. Branch {i}:" for i in range(3)
    ]


def test_concurrent_programs_share_one_client():
    server = ScriptedServer()
    backend = _endpoint(server)

    @sgl.function
    def prog(s, i):
        s += f"Item {i}:" + sgl.gen("x", max_tokens=1)

    states = prog.run_batch([{"i": i} for i in range(16)], backend=backend)
    assert [st["x"] for st in states] == ["ok"] * 16
    gens = [b for b in server.generate_bodies() if b["sampling_params"]["max_new_tokens"]]
    assert sorted(b["text"] for b in gens) == sorted(f"Item {i}:" for i in range(16))


# ---- select ---------------------------------------------------------------------------------
PROMPT = "Q: is the sky blue today and every day ? The answer is "


@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
)
def test_select_scores_all_choices_from_where_any_tokenization_departs(method):
    server = ScriptedServer()

    @sgl.function
    def prog(s):
        s += PROMPT
        s += sgl.select("a", choices=["yes", "no", "maybe not"], choices_method=method)

    state = prog.run(backend=_endpoint(server))
    prompt_tokens = _tokenize(PROMPT)
    n = len(prompt_tokens)
    bodies = server.generate_bodies()
    # 1: the prompt alone, prefill only (caches it, and says how many tokens it is).
    assert bodies[0] == {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}}
    # 2: one batched request, log-probabilities over the last few prompt positions on.
    assert bodies[1] == {
        "text": [PROMPT, PROMPT + "yes", PROMPT + "no", PROMPT + "maybe not"],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": n - 4,
    }
    if method is sgl.unconditional_likelihood_normalized:
        assert bodies[2] == {
            "text": ["yes", "no", "maybe not"],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": 0,
        }
    assert len(bodies) == (3 if method.requires_unconditional_logprobs else 2)

    meta = state.get_meta_info("a")
    # The prompt's trailing " " merges into every choice's first word: scoring starts there.
    start = n - 1
    assert meta["scored_from_position"] == start
    expected = {}
    for choice in ["yes", "no", "maybe not"]:
        tokens = _tokenize(PROMPT + choice)
        expected[choice] = [
            (_logprob(p, tokens[p]), server.vocab[tokens[p]], tokens[p])
            for p in range(start, len(tokens))
        ]
    assert meta["input_token_logprobs"] == list(expected.values())
    means = [sum(lp for lp, _, _ in v) / len(v) for v in expected.values()]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means)
    if method is sgl.unconditional_likelihood_normalized:
        alone = meta["unconditional_token_logprobs"]
        assert alone[0] == [(0.0, server.vocab["yes"], "yes")]  # the first token: no context
        assert alone[2] == [(0.0, server.vocab["maybe"], "maybe"),
                            (_logprob(1, " not"), server.vocab[" not"], " not")]  # fmt: skip
        # Given minus alone, aligned on the choice's last tokens.
        scores = [-1.13, -0.88, ((-1.63 - 0.0) + (-1.14 + 1.01)) / 2]
        assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx(scores)
    else:
        assert state["a"] == "no"  # the shortest token, the best score here
    assert state.text() == PROMPT + state["a"]


def test_select_looks_at_the_whole_prompt_when_a_choice_departs_before_the_window():
    server = ScriptedServer()

    def tokenize(text: str) -> list[str]:  # "!" merges the text's last six words into one token
        tokens = _tokenize(text)
        return [*tokens[:-6], "".join(tokens[-6:])] if text.endswith("!") else tokens

    server.tokenize = tokenize
    backend = _endpoint(server)
    prompt = "one two three four five six seven"
    decision = backend.select(prompt, [" eight", " nine!"], 0.0, sgl.token_length_normalized)
    bodies = server.generate_bodies()
    # The window (the last 4 prompt positions) shows " nine!" departing at its first position
    # or before: the batch is scored again from position 0.
    assert [b.get("logprob_start_len") for b in bodies] == [None, 7 - 4, 0]
    assert bodies[2]["text"] == bodies[1]["text"]
    assert decision.meta_info["scored_from_position"] == 2
    scored = decision.meta_info["input_token_logprobs"]
    assert [t for _, _, t in scored[1]] == [" three four five six seven nine!"]
    assert [t for _, _, t in scored[0]] == [" three", " four", " five", " six", " seven", " eight"]


def test_select_with_temperature_samples_by_score():
    server = ScriptedServer()
    backend = _endpoint(server)
    picks = {
        backend.select(PROMPT, ["yes", "no"], 5.0, sgl.token_length_normalized).decision
        for _ in range(60)
    }
    assert picks == {"yes", "no"}


# ---- streaming ------------------------------------------------------------------------------
class _Events(httpx.SyncByteStream):
    def __init__(self, events: list[Any]) -> None:
        self.lines = [
            f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events
        ]
        self.closed = False

    def __iter__(self):
        yield from self.lines

    def close(self) -> None:
        self.closed = True


def _stream_server(events: list[Any]) -> tuple[ScriptedServer, list[_Events]]:
    server = ScriptedServer()
    streams: list[_Events] = []
    plain = server.handle

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate" and json.loads(request.content).get("stream"):
            server.requests.append(("POST", "/generate", json.loads(request.content)))
            streams.append(_Events(events))
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, stream=streams[-1]
            )
        return plain(request)

    server.handle = handle  # type: ignore[method-assign]
    return server, streams


FINAL_META = {"id": "r", "prompt_tokens": 2, "completion_tokens": 3,
              "finish_reason": {"type": "stop", "matched": 2}}  # fmt: skip
STREAM = [
    {"text": "He", "output_ids": [5], "meta_info": {"id": "r"}},
    {"text": "Hello", "output_ids": [5, 6], "meta_info": {"id": "r"}},
    {"text": "Hello", "output_ids": [5, 6, 7], "meta_info": {"id": "r"}},  # nothing new
    {"text": "Hello!", "output_ids": [5, 6, 7, 8], "meta_info": FINAL_META},
    "[DONE]",
]


def test_a_streamed_gen_turns_cumulative_text_into_pieces():
    server, _ = _stream_server(STREAM)

    @sgl.function
    def prog(s):
        s += "Say:" + sgl.gen("x", max_tokens=4)

    state = prog.run(backend=_endpoint(server), stream=True)
    assert "".join(state.text_iter("x")) == "Hello!"  # pieces may coalesce while we wait
    assert state["x"] == "Hello!"
    assert state.get_meta_info("x") == {**FINAL_META, "output_ids": [5, 6, 7, 8]}
    (body,) = server.generate_bodies()
    assert body["stream"] is True and body["text"] == "Say:"


def test_generate_stream_yields_pieces_then_the_meta_info_and_closes_when_left_early():
    server, streams = _stream_server(STREAM)
    backend = _endpoint(server)
    out = list(backend.generate_stream("Say:", {"max_new_tokens": 4}))
    assert out == [
        ("He", {"id": "r"}),  # each piece with its event's meta_info
        ("llo", {"id": "r"}),
        ("!", FINAL_META),
        ("", {**FINAL_META, "output_ids": [5, 6, 7, 8]}),
    ]
    assert streams[-1].closed

    pieces = backend.generate_stream("Say:", {"max_new_tokens": 4})
    assert next(pieces) == ("He", {"id": "r"})
    pieces.close()  # the consumer stops: the response is closed, so the server aborts
    assert streams[-1].closed


def _logprob_events(incremental: bool) -> list[Any]:
    """A streamed gen with return_logprob: four tokens over three events, the second of which
    has no text yet; per-token lists cumulative, or incremental (SGLang's
    incremental_streaming_output, with output_token_logprobs_length)."""
    lps = [[-0.5, 5, None], [-1.0, 6, None], [-1.5, 7, None], [-2.0, 8, None]]
    events, ends = [], [("He", 1), ("He", 2), ("Hello!", 4)]
    for i, (text, n) in enumerate(ends):
        start = ends[i - 1][1] if incremental and i else 0
        meta = {"id": "r", "prompt_tokens": 2, "completion_tokens": n,
                "output_token_logprobs": lps[start:n]}  # fmt: skip
        if incremental:
            meta["output_token_logprobs_length"] = n
        events.append({"text": text, "output_ids": [5, 6, 7, 8][:n], "meta_info": meta})
    return [*events, "[DONE]"]


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_a_stream_with_logprobs_gives_each_piece_its_own_tokens(incremental):
    server, _ = _stream_server(_logprob_events(incremental))

    @sgl.function
    def prog(s):
        s += "Say:" + sgl.gen("x", max_tokens=4, return_logprob=True)

    state = prog.run(backend=_endpoint(server), stream=True)
    chunks = list(state.text_iter("x", return_meta_data=True))
    assert "".join(text for text, _ in chunks) == "Hello!"
    tokens = [tok for _, meta in chunks for _, tok, _ in meta["output_token_logprobs"]]
    assert tokens == [5, 6, 7, 8]  # every token once, in order, whichever form the server sent
    for _, meta in chunks:
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert meta["prompt_tokens"] == 2
    (body,) = server.generate_bodies()
    assert body["return_logprob"] is True and "return_logprob" not in body["sampling_params"]
    final = state.get_meta_info("x")
    assert [tok for _, tok, _ in final["output_token_logprobs"]] == [5, 6, 7, 8]
    assert final["output_token_logprobs"][0] == (-0.5, 5, None)


def test_an_error_event_mid_stream_raises():
    error = {"error": {"message": "the engine failed", "type": "InternalServerError", "code": 500}}
    server, _ = _stream_server([STREAM[0], error])
    with pytest.raises(EndpointError, match="the engine failed") as info:
        list(_endpoint(server).generate_stream("Say:", {}))
    assert info.value.status_code == 500


# ---- errors, cache, misc ----------------------------------------------------------------------
def test_a_server_error_becomes_an_endpoint_error_with_status_and_message():
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json=MODEL_INFO)
        error = {"message": "max_new_tokens must be >= 0, got -3", "type": "BadRequestError",
                 "param": "max_new_tokens", "code": 400}  # fmt: skip
        return httpx.Response(400, json={"error": error})

    backend = RuntimeEndpoint("http://server", transport=httpx.MockTransport(handle))

    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("x", max_tokens=-3)

    with pytest.raises(EndpointError, match="max_new_tokens must be >= 0") as info:
        prog.run(backend=backend)
    assert isinstance(info.value, RuntimeError)
    assert info.value.status_code == 400
    assert info.value.error_type == "BadRequestError"


def test_an_unreachable_server_is_named_in_the_error():
    with pytest.raises(EndpointError, match=r"cannot reach .* at http://127\.0\.0\.1:1") as info:
        RuntimeEndpoint("http://127.0.0.1:1", timeout=5)
    assert info.value.status_code is None


def test_flush_cache_says_whether_the_server_flushed():
    answers = iter([200, 409])

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json=MODEL_INFO)
        assert (request.method, request.url.path) == ("POST", "/flush_cache")
        return httpx.Response(next(answers), text="")

    backend = RuntimeEndpoint("http://server", transport=httpx.MockTransport(handle))
    assert backend.flush_cache() is True
    assert backend.flush_cache() is False


def test_api_key_server_info_and_shutdown():
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"version": "x"})
        return httpx.Response(200, json=MODEL_INFO)

    with RuntimeEndpoint(
        "http://server/", api_key="sk-1", transport=httpx.MockTransport(handle)
    ) as backend:
        assert backend.get_server_info() == {"version": "x"}
    assert backend.client.is_closed
    assert all(r.headers["authorization"] == "Bearer sk-1" for r in seen)
    assert [str(r.url) for r in seen] == [
        "http://server/get_model_info",
        "http://server/get_server_info",
    ]


# ---- against the real radixlang server ------------------------------------------------------
# The same programs, greedy, through RuntimeEndpoint (HTTP) and LocalBackend (in process) on
# one engine: the server path must not change a single token or score.
@pytest.fixture(scope="module")
def endpoint(server):
    backend = RuntimeEndpoint(server.url)
    yield backend
    backend.shutdown()


def _same_run(program, endpoint, local, **kwargs):
    remote = program.run(backend=endpoint, temperature=0, **kwargs)
    here = program.run(backend=local, temperature=0, **kwargs)
    assert remote.text() == here.text()
    assert remote.messages() == here.messages()
    return remote, here


def test_the_servers_chat_template_reads_as_the_local_one(endpoint, local):
    assert endpoint.get_chat_template() == local.get_chat_template()
    assert endpoint.model_info["is_generation"] is True


@pytest.mark.compares_outputs
def test_a_multi_turn_chat_matches_the_local_backend(endpoint, local):
    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        s += sgl.user("Name a color.")
        s += sgl.assistant(sgl.gen("a1", max_tokens=8))
        s += sgl.user("And another one?")
        s += sgl.assistant(sgl.gen("a2", max_tokens=8))

    remote, here = _same_run(chat, endpoint, local)
    assert remote["a1"] == here["a1"] and remote["a2"] == here["a2"]
    meta, local_meta = remote.get_meta_info("a2"), here.get_meta_info("a2")
    assert meta["output_ids"] == local_meta["output_ids"]
    assert meta["prompt_tokens"] == local_meta["prompt_tokens"]
    assert meta["finish_reason"] == local_meta["finish_reason"]


@pytest.mark.compares_outputs
def test_fork_join_with_three_branches_matches_and_prefills_the_prefix_first(
    server, local, recording
):
    @sgl.function
    def ideas(s):
        s += sgl.user("Give three ideas.")
        s += sgl.assistant_begin()
        forks = s.fork(3)
        forks += lambda i: f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=6, stop="\n")
        forks.join()
        s += "Best:" + sgl.gen("best", max_tokens=5)
        s += sgl.assistant_end()

    endpoint = RuntimeEndpoint(server.url, transport=recording)
    remote, here = _same_run(ideas, endpoint, local)
    assert len(remote["idea"]) == 3 and remote["idea"] == here["idea"]
    assert remote["best"] == here["best"]
    bodies = [b for _, path, b in recording.requests if path == "/generate"]
    prefix = bodies[0]["text"]
    assert bodies[0] == {"text": prefix, "sampling_params": {"max_new_tokens": 0}}
    assert prefix.endswith("<|im_start|>assistant\n")
    assert sorted(b["text"] for b in bodies[1:4]) == [prefix + f"Idea {i}:" for i in (1, 2, 3)]


SELECT_CASES = [
    ("Question: is water wet?\nAnswer:", [" yes", " no", " it depends on the context"]),
    ("The answer is ", ["yes", "no"]),  # the prompt's trailing space merges into the choice
]


@pytest.mark.compares_outputs
@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
)
@pytest.mark.parametrize(("prompt", "choices"), SELECT_CASES)
def test_select_decides_and_scores_as_the_local_backend(
    server, local, recording, method, prompt, choices
):
    @sgl.function
    def pick(s):
        s += prompt + sgl.select("a", choices=choices, choices_method=method)

    endpoint = RuntimeEndpoint(server.url, transport=recording)
    remote, here = _same_run(pick, endpoint, local)
    assert remote["a"] == here["a"]
    meta, local_meta = remote.get_meta_info("a"), here.get_meta_info("a")
    assert meta["scored_from_position"] == local_meta["scored_from_position"]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(
        local_meta["normalized_prompt_logprobs"], abs=1e-4
    )
    for got, want in zip(meta["input_token_logprobs"], local_meta["input_token_logprobs"],
                         strict=True):  # fmt: skip
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _, _ in want], abs=1e-4)
    key = {
        sgl.greedy_token_selection: "greedy_logprob_matrix",
        sgl.unconditional_likelihood_normalized: "normalized_unconditional_prompt_logprobs",
    }.get(method)
    if key is not None:
        got, want = meta[key], local_meta[key]
        if key == "greedy_logprob_matrix":
            got, want = [x for row in got for x in row], [x for row in want for x in row]
        assert got == pytest.approx(want, abs=1e-4)
    # One prefill-only request, one batched scoring request (and one for the choices alone).
    scoring = [b for _, path, b in recording.requests if path == "/generate"]
    assert len(scoring) == (3 if method.requires_unconditional_logprobs else 2)
    assert scoring[1]["text"] == [prompt] + [prompt + c for c in choices]


@pytest.mark.compares_outputs
def test_regex_and_gen_int_match_the_local_backend(endpoint, local):
    @sgl.function
    def constrained(s):
        s += "Is it raining? " + sgl.gen("yn", regex=r"(yes|no)", max_tokens=4)
        s += "\nHow many days? " + sgl.gen_int("days", max_tokens=4)

    remote, here = _same_run(constrained, endpoint, local)
    assert remote["yn"] in ("yes", "no") and remote["yn"] == here["yn"]
    assert re.fullmatch(r"-?\d+", remote["days"]) and remote["days"] == here["days"]


@pytest.mark.compares_outputs
def test_a_streamed_program_matches_the_local_backend(endpoint, local):
    @sgl.function
    def story(s):
        s += sgl.user("Tell a story.")
        s += sgl.assistant(sgl.gen("story", max_tokens=24, ignore_eos=True))

    streamed = story.run(backend=endpoint, temperature=0, stream=True)
    pieces = list(streamed.text_iter("story"))
    here = story.run(backend=local, temperature=0)
    assert "".join(pieces) == streamed["story"] == here["story"]
    assert streamed.text() == here.text()
    meta = streamed.get_meta_info("story")
    assert meta["completion_tokens"] == 24
    assert meta["output_ids"] == here.get_meta_info("story")["output_ids"]


def test_server_errors_and_flush_cache_over_http(endpoint):
    @sgl.function
    def too_long(s):
        s += "word " * 2000  # past the tiny model's 1024-token context
        s += sgl.gen("x", max_tokens=4)

    with pytest.raises(EndpointError) as info:
        too_long.run(backend=endpoint)
    assert info.value.status_code == 400 and "context" in str(info.value)
    assert endpoint.flush_cache() is True
    assert (
        endpoint.get_server_info()["served_model_name"] == endpoint.model_info["served_model_name"]
    )


def test_leaving_a_stream_early_aborts_the_request_on_the_server(endpoint, engine):
    aborted = engine.stats()["finished_abort"]
    sampling = {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True}
    # Held after its first token: the request ends only when the server aborts it.
    with hold_steps(engine, after_tokens=1):
        pieces = endpoint.generate_stream("Once upon a time", sampling)
        assert next(pieces)[0]
        pieces.close()  # closes the connection; the server notices and aborts
        deadline = time.monotonic() + 10
        while engine.stats()["finished_abort"] == aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = engine.stats()
    assert stats["finished_abort"] == aborted + 1
    assert stats["running_requests"] == 0


# ---- routing keys -----------------------------------------------------------------------------
def test_a_programs_requests_and_its_forks_carry_one_routing_key():
    """For a server with several replicas: every request of one run (its prefill-only fork
    request, each branch, n samples) has the run's X-Routing-Key; another run has another."""
    server = ScriptedServer()
    keys: list[tuple[str, str | None]] = []
    handle = server.handle

    def recording(request: httpx.Request) -> httpx.Response:
        keys.append((request.url.path, request.headers.get("x-routing-key")))
        return handle(request)

    backend = RuntimeEndpoint("http://server", transport=httpx.MockTransport(recording))

    @sgl.function
    def branches(s):
        s += "A shared start."
        forks = s.fork(2)
        for f in forks:
            f += " Next:" + sgl.gen("x", max_tokens=2)
        s += sgl.gen("many", max_tokens=2, n=2)

    runs = []
    for _ in range(2):
        keys.clear()
        branches.run(backend=backend)
        sent = [key for path, key in keys if path == "/generate"]
        assert len(sent) == 5 and len(set(sent)) == 1 and sent[0].startswith("program-"), keys
        runs.append(sent[0])
    assert runs[0] != runs[1]
