"""GET /kv_events: a server started with kv_events announces its radix cache's blocks, as a
router of the user's own would follow them."""

from __future__ import annotations

import httpx
import pytest

from radixlang.runtime.kv_events import KvEventLog, block_hashes


@pytest.fixture(scope="module")
def served(chat_model_dir):
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve_in_thread

    engine = Engine(str(chat_model_dir), dtype="float32", kv_memory="16MiB", kv_events=True)
    with serve_in_thread(engine, dashboard=False) as server:
        yield engine, server
    engine.shutdown(free_cache=True)


def test_the_events_name_the_cached_blocks_of_a_prompt(served):
    _, server = served
    with httpx.Client(base_url=server.url, timeout=60) as client:
        start = client.get("/kv_events").json()["last_seq"]
        text = (
            "A prompt long enough to fill a few blocks of sixteen tokens each, and then some more."
        )
        out = client.post("/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": 3, "temperature": 0}, "return_prompt_token_ids": True})  # fmt: skip
        tokens = out.json()["prompt_token_ids"] + out.json()["output_ids"]
        got = client.get("/kv_events", params={"after": start}).json()
        assert got["gap"] is False and got["block_size"] == 16
        stored = {h for e in got["events"] if e["kind"] == "stored" for h in e["hashes"]}
        # Stored events say where the blocks are: this engine has no tier, all on the device.
        assert {e.get("medium") for e in got["events"] if e["kind"] == "stored"} == {"device"}
        # Every full block of the finished sequence (prompt and output but the last token, which
        # has no KV yet) is announced, by the hash a router computes from the tokens.
        assert set(block_hashes(tokens[:-1], 16)) <= stored and stored
        again = client.get("/kv_events", params={"after": got["last_seq"]}).json()
        assert again["events"] == [] and again["last_seq"] == got["last_seq"]
        assert client.post("/flush_cache").status_code == 200
        kinds = [e["kind"] for e in client.get("/kv_events", params={"after": got["last_seq"]})
                 .json()["events"]]  # fmt: skip
        assert kinds == ["cleared"]
        assert client.get("/kv_events", params={"after": "-1"}).status_code == 400


def test_a_reader_that_fell_behind_gets_a_snapshot(served):
    engine, server = served
    engine._call(lambda: engine.cache.enable_kv_events(KvEventLog(capacity=2)))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(3):  # three distinct sequences: more events than the log keeps
            body = {"text": f"Sequence {i} " * 12, "sampling_params": {"max_new_tokens": 1}}
            assert client.post("/generate", json=body).status_code == 200
        got = client.get("/kv_events", params={"after": 0}).json()
    assert got["gap"] is True and got["events"] == []
    snapshot = {h for node in got["snapshot"] for h in node["hashes"]}
    assert {node["medium"] for node in got["snapshot"]} == {"device"}
    assert snapshot == {h for _, hashes in engine.cache.block_hashes() for h in hashes}
    assert len(snapshot) >= 3


def test_a_server_without_kv_events_says_so(server):
    r = httpx.get(server.url + "/kv_events")
    assert r.status_code == 400 and "--kv-events" in r.json()["error"]["message"]
