"""SGLang's native API (/generate and friends) on a real server, driven with httpx."""

from __future__ import annotations

import itertools
import json
import socket

import httpx
import pytest
from engine_gate import hold_steps  # tests/, on the path through tests/conftest.py
from server_checks import assert_no_leak, fresh_cache, metrics, wait_idle

GREEDY = {"max_new_tokens": 12, "temperature": 0}


def generate(client: httpx.Client, **body) -> dict | list:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(client: httpx.Client, **body) -> list[dict]:
    chunks = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunks.append(json.loads(line[len("data: ") :]))
    return chunks


@pytest.mark.compares_outputs
def test_generate_matches_the_engine(client, engine):
    fresh_cache(client)  # the server's request computes its whole prompt
    out = generate(client, text="The capital of France is", sampling_params=GREEDY)
    alone = engine.generate("The capital of France is", GREEDY)
    assert out["text"] == alone.text
    assert out["output_ids"] == alone.output_ids
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(alone.prompt_ids)
    assert meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["cached_tokens"] == 0
    assert alone.cached_tokens == meta["prompt_tokens"] - 1  # the server's request cached it


@pytest.mark.compares_outputs
def test_batch_input_ids_and_per_item_sampling(client, engine):
    prompts = ["one two three", "four five"]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    params = [{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 5, "temperature": 0}]
    by_text = generate(client, text=prompts, sampling_params=params)
    by_ids = generate(client, input_ids=ids, sampling_params=params)
    assert isinstance(by_text, list) and len(by_text) == 2
    assert [o["meta_info"]["completion_tokens"] for o in by_text] == [3, 5]
    assert [o["text"] for o in by_text] == [o["text"] for o in by_ids]


def test_prefill_only_request_caches_the_prompt(client):
    fresh_cache(client)
    text = "A prompt cached ahead of its branches: " + "alpha beta " * 20
    out = generate(client, text=text, sampling_params={"max_new_tokens": 0})
    assert out["text"] == "" and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    again = generate(client, text=text + "gamma", sampling_params={"max_new_tokens": 1})
    assert again["meta_info"]["cached_tokens"] >= out["meta_info"]["prompt_tokens"] - 1


@pytest.mark.compares_outputs
def test_logprobs_shape_and_start(client, engine):
    text = "Scores of every token from the third on"
    n = len(engine.tokenizer.encode(text))
    out = generate(
        client,
        text=text,
        sampling_params={"max_new_tokens": 2, "temperature": 0},
        return_logprob=True,
        logprob_start_len=2,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    assert len(meta["input_token_logprobs"]) == n - 2
    assert len(meta["output_token_logprobs"]) == 2
    for lp, tok, piece in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert lp <= 0 and isinstance(tok, int) and piece == engine.tokenizer.decode([tok])
    assert all(len(top) == 3 for top in meta["output_top_logprobs"])
    # Greedy: the chosen token is the best of the top list.
    pairs = zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True)
    for (lp, tok, _), top in pairs:
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp)
    whole = generate(
        client,
        text=text,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    first = whole["meta_info"]["input_token_logprobs"]
    assert first[0][0] is None and first[0][2] is None  # no text without return_text_in_logprobs
    assert [x[0] for x in first[2:]] == pytest.approx([x[0] for x in meta["input_token_logprobs"]])


@pytest.mark.compares_outputs
def test_stop_string_and_no_stop_trim(client):
    base = generate(client, text="Count: 1 2 3", sampling_params=GREEDY)["text"]
    stop = base[3:6]
    assert stop.strip(), "the greedy text is long enough to hold a stop string"
    params = {**GREEDY, "stop": [stop]}
    out = generate(client, text="Count: 1 2 3", sampling_params=params)
    assert out["text"] == base[: base.index(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    kept = generate(client, text="Count: 1 2 3", sampling_params={**params, "no_stop_trim": True})
    assert kept["text"] == base[: base.index(stop)] + stop


def test_regex_and_n_samples(client):
    out = generate(client, text="Year:", sampling_params={"max_new_tokens": 8, "regex": "[0-9]{4}"})
    assert len(out["text"]) == 4 and out["text"].isdigit()
    many = generate(client, text="Pick:", sampling_params={"max_new_tokens": 6, "n": 3, "seed": 7})
    assert isinstance(many, list) and len(many) == 3
    assert len({m["text"] for m in many}) > 1  # seeds 7, 8, 9: three samples, not three copies


@pytest.mark.compares_outputs
@pytest.mark.parametrize(
    "body",
    [
        {"text": "Stream me some text", "sampling_params": GREEDY},
        {"text": "Stream with stops", "sampling_params": {**GREEDY, "stop": ["e"]}},
        {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 7, "temperature": 0}},
    ],
)
def test_stream_equals_non_stream(client, body):
    whole = generate(client, **body)
    chunks = stream_chunks(client, **body)
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative
    assert texts[-1] == whole["text"]
    assert chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert chunks[-1]["meta_info"]["prompt_tokens"] == whole["meta_info"]["prompt_tokens"]


@pytest.mark.compares_outputs
def test_batch_stream_tags_items_with_their_index(client):
    body = {"text": ["first prompt", "second prompt here"], "sampling_params": GREEDY}
    whole = generate(client, **body)
    finals: dict[int, dict] = {}
    for chunk in stream_chunks(client, **body):
        finals[chunk["index"]] = chunk
    assert [finals[i]["text"] for i in range(2)] == [w["text"] for w in whole]


def test_sglang_select_request_shape(client, engine):
    """The request SGLang's RuntimeEndpoint.select sends: every choice scored in one batch."""
    prompt = "Is the sky blue? Answer:"
    n = generate(client, text=prompt, sampling_params={"max_new_tokens": 0})["meta_info"][
        "prompt_tokens"
    ]
    out = generate(
        client,
        text=[prompt + c for c in (" yes", " no")],
        sampling_params={"max_new_tokens": 0, "temperature": 0},
        return_logprob=True,
        return_text_in_logprobs=True,
        logprob_start_len=max(n - 2, 0),
    )
    for item in out:
        logprobs = item["meta_info"]["input_token_logprobs"]
        assert logprobs and all(lp is not None for lp, _, _ in logprobs)
        assert item["meta_info"]["output_token_logprobs"] == []


def test_client_disconnect_aborts_a_stream(client, server, engine):
    before = metrics(client)['radixlang_requests_finished_by_reason_total{reason="abort"}']
    body = {"text": "Go on and on", "stream": True,
            "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}  # fmt: skip
    # Held after its first token: the request ends only when the server aborts it.
    with hold_steps(engine, after_tokens=1):
        with (
            httpx.Client(base_url=server.url, timeout=60) as c,
            c.stream("POST", "/generate", json=body) as r,
        ):
            next(line for line in r.iter_lines() if line.startswith("data:"))
        m = wait_idle(client)
    assert m['radixlang_requests_finished_by_reason_total{reason="abort"}'] == before + 1
    assert_no_leak(client)


def test_client_disconnect_aborts_a_plain_request(client, server, engine):
    before = metrics(client)['radixlang_requests_finished_by_reason_total{reason="abort"}']
    body = json.dumps({"text": "Go on and on",
                       "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})  # fmt: skip
    request = (f"POST /generate HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")  # fmt: skip
    # A client that gives up on its answer (a timeout) once the engine runs its request: held
    # after its first token, the request ends only when the server aborts it.
    with hold_steps(engine, after_tokens=1) as gate:
        with socket.create_connection((server.host, server.port), timeout=60) as sock:
            sock.sendall(request.encode())
            gate.wait_holding()
        m = wait_idle(client)
    assert m['radixlang_requests_finished_by_reason_total{reason="abort"}'] == before + 1
    assert_no_leak(client)


def test_admin_routes(client, engine):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["is_generation"] and info["model_path"] == str(engine.files.path)
    assert info["chat_template"] == engine.tokenizer.chat_template
    assert info["max_context_length"] == engine.max_context
    server_info = client.get("/get_server_info").json()
    assert server_info["num_blocks"] == engine.pool.num_blocks
    assert client.get("/server_info").json()["block_size"] == engine.pool.block_size
    assert client.post("/concate_and_append_request",
                       json={"src_rids": ["a"], "dst_rid": "b"}).status_code == 200  # fmt: skip
    assert client.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
    wait_idle(client)
    assert client.post("/flush_cache").json()["success"] is True
    m = metrics(client)
    assert m["radixlang_kv_blocks_used"] == 0 and m["radixlang_cached_tokens"] == 0
    assert m['radixlang_http_requests_total{route="/flush_cache",code="200"}'] >= 1
    engine.check_integrity()


def test_tokenize_and_detokenize(client, engine):
    out = client.post("/tokenize", json={"text": "Hello world", "add_special_tokens": False})
    tokens = engine.tokenizer.encode("Hello world", add_special_tokens=False)
    assert out.json()["tokens"] == tokens and out.json()["count"] == len(tokens)
    back = client.post("/detokenize", json={"tokens": tokens}).json()
    assert back == {"text": "Hello world"}
    bad = client.post("/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_api_key_guards_every_route_but_health_and_metrics(engine):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine, api_key="sesame") as srv, httpx.Client(base_url=srv.url) as c:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        refused = c.post("/generate", json=body)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        wrong = c.post("/generate", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert c.get("/v1/models").status_code == 401
        key = {"Authorization": "Bearer sesame"}
        assert c.post("/generate", json=body, headers=key).status_code == 200
        assert c.get("/v1/models", headers=key).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_a_failed_forward_is_a_500_and_the_server_goes_on(client, engine, monkeypatch):
    real = engine.runner.forward

    def broken(*args, **kwargs):
        monkeypatch.setattr(engine.runner, "forward", real)  # only this step fails
        raise RuntimeError("injected fault")

    wait_idle(client)
    monkeypatch.setattr(engine.runner, "forward", broken)
    body = {"text": "Fail once", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    failed = client.post("/generate", json=body)
    assert failed.status_code == 500
    assert "injected fault" in failed.json()["error"]["message"]
    assert client.post("/generate", json=body).status_code == 200
    assert_no_leak(client)


def test_cache_salt_separates_cached_prefixes(client):
    fresh_cache(client)
    text = "A long shared system prompt for salted requests: " + "gamma delta " * 20
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        return generate(client, **body, **extra)["meta_info"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 20  # reused within the salt
    assert cached("tenant-b") == 0  # never across salts
    assert cached(None) == 0  # nor by the default salt
    assert cached(None) > 20
    for bad, why in (("x" * 257, "at most 256"), (7, "string")):
        refused = client.post("/generate", json={**body, "cache_salt": bad})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "cache_salt" and why in error["message"], error
    assert_no_leak(client)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_api_keys_file_gives_each_tenant_its_own_cache(engine, client, tmp_path, suffix):
    from radixlang.server.app import serve_in_thread

    fresh_cache(client)  # through the module's server: this one's routes need a key

    keys = tmp_path / f"keys{suffix}"
    if suffix == ".json":
        keys.write_text(json.dumps({"key-one": "alice", "key-two": "bob", "key-3": "alice"}))
    else:
        keys.write_text('key-one = "alice"\nkey-two = "bob"\nkey-3 = "alice"\n')
    text = f"{suffix[1:]}: the tenants' shared prompt, " + "epsilon zeta " * 20
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    with (
        serve_in_thread(engine, api_keys_file=str(keys)) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):

        def cached(key: str, salt: str | None = None) -> int:
            extra = {} if salt is None else {"cache_salt": salt}
            headers = {"Authorization": f"Bearer {key}"}
            out = c.post("/generate", json={**body, **extra}, headers=headers)
            assert out.status_code == 200, out.text
            return out.json()["meta_info"]["cached_tokens"]

        assert cached("key-one") == 0
        assert cached("key-one") > 20  # within a tenant
        assert cached("key-3") > 20  # another key of the same tenant
        assert cached("key-two") == 0  # never across tenants
        assert cached("key-two", "s") == 0 and cached("key-one", "s") == 0  # even with a salt
        assert cached("key-one", "s") > 20
        assert c.post("/generate", json=body).status_code == 401
        wrong = c.post("/generate", json=body, headers={"Authorization": "Bearer key-four"})
        assert wrong.status_code == 401
        assert c.get("/health").status_code == 200
        wait_idle(c)
